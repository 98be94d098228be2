-- 0012: the console's reads of jobs that did not succeed, at scale (measured with 1M-6M finished rows):
-- * the overview's failed and dead-lettered counts (stats_dead) read them through this index alone
--   (an index-only scan), not the whole table: 424 ms at 100k dead letters among 1.1M rows, 34-45 ms now;
-- * the jobs list filtered on failed, dead_lettered or cancelled (list_jobs) walks this index newest first
--   instead of every finished row's: 1.5 s at 6M, 0.2 ms.
-- Both are partial: a job enters them only when it fails, dies or is cancelled, never on the hot path of a
-- claim and its success.
CREATE INDEX job_queue_unsuccessful_counts_idx ON job_queue (queue, job_type, state)
    WHERE state IN ('failed', 'dead_lettered');
CREATE INDEX job_queue_unsuccessful_idx ON job_queue (state, finished_at DESC, id)
    WHERE state IN ('failed', 'dead_lettered', 'cancelled');
