-- 0010: the jobs list's index of waiting jobs (0009) in the list's order, and kept apart from the claims'
-- both ways. (0009 was applied to databases of its first form: migrations are forward-only. The index
-- covers only the waiting jobs: building it again is quick.)
-- The id makes the index's order the list's, ties included: with statistics that expected one waiting
-- job the planner sorted all of them to break ties.
-- "(...) IS TRUE": the list's condition (stats.list_jobs), written so, implies no other index's
-- predicate, so the list cannot take the ready index (by priority) and sort every waiting job (8 ms at
-- 10,000 in the bench; seconds at a million). "updated_at > '-infinity'" (always true), as in 0009: no
-- claim implies it, so none can read this index.
DROP INDEX IF EXISTS job_queue_waiting_updated_idx;
CREATE INDEX job_queue_waiting_updated_idx ON job_queue (updated_at DESC, id)
    WHERE (state IN ('queued', 'retry_scheduled')) IS TRUE AND updated_at > '-infinity';
