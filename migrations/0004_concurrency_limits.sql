-- 0004: global concurrency limits per job type (optionally per queue), enforced by the claim itself.
-- A worker upserts the limits its @task(concurrency=N) declare; an operator may set or clear one with
-- `qconsole limit`. queue '*' means every queue.

CREATE TABLE concurrency_limits (
    job_type     text NOT NULL,
    queue        text NOT NULL DEFAULT '*',
    max_running  integer NOT NULL CHECK (max_running >= 0),
    source       text NOT NULL,
    reason       text,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_type, queue)
);
