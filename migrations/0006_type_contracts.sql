-- 0006: the effective contract of each job type, as the workers that run it registered it (policy values
-- with where each comes from, the override's reason, its concurrency limit). The console and
-- `qconsole policies` read it, so operators see what the fleet actually runs.

CREATE TABLE job_type_contracts (
    job_type                  text PRIMARY KEY,
    queue                     text NOT NULL,
    contract                  jsonb NOT NULL,
    reason                    text,
    requires_idempotency_key  boolean NOT NULL DEFAULT false,
    concurrency               integer,
    reported_by               text NOT NULL,
    reported_at               timestamptz NOT NULL
);
