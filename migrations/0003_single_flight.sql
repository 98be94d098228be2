-- 0003: single-flight refills. The refill lease is a lock_key lease ("single-flight:<key>"); the value the
-- winner computed is kept here until it expires, so the jobs that waited read it instead of refilling.

CREATE TABLE single_flight_results (
    key          text PRIMARY KEY,
    value        jsonb NOT NULL,
    refilled_at  timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);
CREATE INDEX single_flight_results_expires_idx ON single_flight_results (expires_at);
