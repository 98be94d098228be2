-- 0009: the jobs list's "newest activity first" without an index that every transition writes to.
-- job_queue_updated_idx (0007) held an entry for every row version: a claim and a settlement each added
-- one, two of the nine index entries a job's transitions write (no-op drains ran 7-10% faster without
-- it). The list reads three ordered sources instead (stats.list_jobs): waiting jobs through this index,
-- running jobs (as many as the workers hold) sorted, finished jobs through job_queue_finished_idx (a
-- finished job's updated_at is its finished_at: nothing else updates a finished row but a requeue, which
-- makes it waiting again).
DROP INDEX IF EXISTS job_queue_updated_idx;
CREATE INDEX job_queue_waiting_updated_idx ON job_queue (updated_at DESC)
    WHERE state IN ('queued', 'retry_scheduled');
