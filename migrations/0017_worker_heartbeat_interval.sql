-- 0017_worker_heartbeat_interval: each worker's heartbeat interval, in its row. A worker was judged lost
-- when its row had not been beaten for 30 s, whatever its interval: a worker beating every 30 s read as
-- lost between every two beats, so the CLI refused an interval above 10 s (WorkerConfig did not). The
-- console and the CLI now judge a worker against its own interval (stats.lost_after_seconds: three
-- intervals, 30 s at least). NULL: a worker of an earlier version, judged by the 30 s rule. A column
-- without a default: nothing is rewritten, and the lock on workers is held a moment.
ALTER TABLE workers ADD COLUMN heartbeat_interval_seconds real
    CHECK (heartbeat_interval_seconds > 0);
COMMENT ON COLUMN workers.heartbeat_interval_seconds IS
    'How often this worker beats its row (seconds); it reads as lost after three intervals (30 s at least).';
