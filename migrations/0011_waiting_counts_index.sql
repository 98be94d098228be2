-- 0011: no index holds every live state any more; a claim makes one index entry fewer.
-- job_queue_live_idx (0007) took an entry for each job its claim made running, on top of the running
-- index's: ~15% of the server's CPU of a claim and its settlement (bench/ceilings.py). The console's
-- counts read the waiting jobs through this index and the running ones (as many as the workers hold)
-- through job_queue_running_idx (stats_live, burst_remaining in queries.sql).
-- The predicate is written as 0010's, with a term no claim and no list of jobs implies
-- ("scheduled_at > '-infinity'", always true): neither can take this index and sort what it reads.
DROP INDEX IF EXISTS job_queue_live_idx;
CREATE INDEX job_queue_waiting_idx ON job_queue (queue, job_type, state)
    WHERE (state IN ('queued', 'retry_scheduled')) IS TRUE AND scheduled_at > '-infinity';
