-- 0013: the dead-letter screen's groups (dead_letter_groups, group_ids) read the failed, dead-lettered
-- and retrying jobs through this index, already grouped (job type, fingerprint, state): measured with
-- 100,000 dead letters in 5,000 groups among 1.1M rows, the grouping scanned and sorted the whole table on
-- disk (1.3 s a refresh). updated_at rides along, so the counts and their first and last times come from
-- the index alone. Partial: a job enters it when it fails, dies or waits for a retry, never on the hot
-- path of a claim and its success.
CREATE INDEX job_queue_error_groups_idx ON job_queue (job_type, error_fingerprint, state, finished_at DESC)
    INCLUDE (updated_at)
    WHERE state IN ('dead_lettered', 'failed', 'retry_scheduled');
