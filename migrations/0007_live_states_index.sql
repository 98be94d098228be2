-- 0007: indexes for the console on a table of millions of finished rows.
-- One partial index over every live state, so the overview's counts per queue and type never touch the
-- finished rows (the ready and running indexes each cover only part of them).
CREATE INDEX job_queue_live_idx ON job_queue (queue, job_type, state)
    WHERE state IN ('queued', 'running', 'retry_scheduled');

-- The console's job list, newest activity first, without sorting the whole table.
CREATE INDEX job_queue_updated_idx ON job_queue (updated_at DESC);
