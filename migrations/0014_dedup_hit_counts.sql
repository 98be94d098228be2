-- Dedup hits, counted by producers in their own transactions, are appended here and folded into
-- job_metrics_minute by housekeeping. They were an upsert of the (minute, queue, type) row of
-- job_metrics_minute: a producer whose enqueue was a dedup hit held that row locked until its business
-- transaction ended, and every other producer's hit for the same type, and every worker's metrics flush on
-- its heartbeat, waited for it (two producers hitting two types in opposite order deadlocked). Rows
-- without a key take no lock anyone else waits for. Readers add what is not folded yet (stats_window).
CREATE TABLE dedup_hit_counts (
    minute    timestamptz NOT NULL,
    queue     text NOT NULL,
    job_type  text NOT NULL,
    hits      bigint NOT NULL
);
