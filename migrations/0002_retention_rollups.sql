-- 0002: history that survives retention.
-- "Jobs in" per minute is rolled up from created_at by the housekeeping winner (a BRIN index keeps the
-- scan to the newest blocks); dedup hits are counted by producers on the (rare) duplicate path.

ALTER TABLE job_metrics_minute ADD COLUMN enqueued bigint NOT NULL DEFAULT 0;

CREATE INDEX job_queue_created_brin ON job_queue USING brin (created_at);

-- Watermarks of periodic work, so a restart of every worker neither skips nor repeats a minute.
CREATE TABLE housekeeping (
    name        text PRIMARY KEY,
    watermark   timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
