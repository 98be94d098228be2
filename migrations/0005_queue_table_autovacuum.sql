-- 0005: a queue table churns: every job is inserted, updated several times and deleted. Vacuum and analyze
-- it far more eagerly than the defaults (20% / 10% of the table), so dead tuples and planner statistics
-- stay current while the live part stays small.
ALTER TABLE job_queue SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 1000,
    fillfactor = 85
);
