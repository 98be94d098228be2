-- 0015_kill_releases_dedup_key: a running job an operator kills gives up its dedup key at once.
-- Until its worker saw the kill (a heartbeat, or its lease for an orphan), an equivalent message enqueued
-- meanwhile collapsed into the doomed job and was lost. The key moves here, out of the unique index (whose
-- predicate, which producers name in ON CONFLICT, stays as it is), and a requeue gives it back.
-- Adding a nullable column without a default rewrites nothing: no wait on upgrade.
ALTER TABLE job_queue ADD COLUMN released_dedup_key text;
COMMENT ON COLUMN job_queue.released_dedup_key IS
    'The dedup key of a running job an operator killed, released at the kill; a requeue restores it.';
