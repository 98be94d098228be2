-- 0001_init: the job contract's tables.
-- Forward-only. Applied by worker_core.migrate under an advisory lock and recorded in worker_core_migrations.

CREATE TABLE job_queue (
    id                          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    job_type                    text NOT NULL CHECK (job_type ~ '^[a-z0-9_.-]+$'),
    queue                       text NOT NULL DEFAULT 'default' CHECK (queue ~ '^[A-Za-z0-9_.:-]+$'),
    payload                     jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(payload) = 'object'),
    state                       text NOT NULL DEFAULT 'queued' CHECK (state IN (
                                    'queued', 'running', 'retry_scheduled', 'succeeded',
                                    'failed', 'dead_lettered', 'cancelled')),
    priority                    integer NOT NULL DEFAULT 0,
    attempts                    integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts                integer NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    scheduled_at                timestamptz NOT NULL DEFAULT now(),
    locked_until                timestamptz,
    locked_by                   text,
    idempotency_key             text,
    dedup_key                   text,
    lock_key                    text,
    timeout_seconds             double precision NOT NULL DEFAULT 60 CHECK (timeout_seconds > 0),
    visibility_timeout_seconds  double precision NOT NULL DEFAULT 90,
    retry_policy                jsonb NOT NULL DEFAULT '{}',
    tenant_id                   text,
    trace_id                    text,
    last_error                  text,
    -- last_error with numbers, ids and quoted values normalized away: groups dead letters
    error_fingerprint           text,
    -- one entry per failed attempt or lease expiration:
    -- {"attempt", "class", "kind", "message", "worker", "at"}
    errors                      jsonb NOT NULL DEFAULT '[]',
    lease_expirations           integer NOT NULL DEFAULT 0,
    -- its lease expired while it shared a process with other jobs: it may have killed that process, so
    -- it runs alone until it settles, and only a lease lost while alone counts it as a poison pill
    suspect                     boolean NOT NULL DEFAULT false,
    ran_solo                    boolean NOT NULL DEFAULT false,
    cancel_requested            boolean NOT NULL DEFAULT false,
    created_at                  timestamptz NOT NULL DEFAULT now(),
    started_at                  timestamptz,
    finished_at                 timestamptz,
    updated_at                  timestamptz NOT NULL DEFAULT now(),
    CHECK (visibility_timeout_seconds > timeout_seconds)
);

COMMENT ON TABLE job_queue IS 'One row per job. States and transitions: see DESIGN.md; only worker_core writes here.';

-- The claim: ready jobs in order. Partial, so millions of finished rows cost nothing.
CREATE INDEX job_queue_ready_idx ON job_queue (priority, scheduled_at, id)
    WHERE state IN ('queued', 'retry_scheduled');
-- Lease expirations: running jobs by lease end.
CREATE INDEX job_queue_running_idx ON job_queue (locked_until)
    WHERE state = 'running';
-- Suspects waiting to run alone.
CREATE INDEX job_queue_suspect_idx ON job_queue (priority, scheduled_at, id)
    WHERE suspect AND state IN ('queued', 'retry_scheduled');
-- Dedup: two equivalent live messages are one job.
CREATE UNIQUE INDEX job_queue_dedup_live_idx ON job_queue (dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('queued', 'running', 'retry_scheduled');
-- Dead letters and failures, grouped by type in the console.
CREATE INDEX job_queue_dead_idx ON job_queue (job_type, finished_at)
    WHERE state IN ('dead_lettered', 'failed');
-- Retention of finished jobs.
CREATE INDEX job_queue_finished_idx ON job_queue (finished_at)
    WHERE state IN ('succeeded', 'failed', 'dead_lettered', 'cancelled');
CREATE INDEX job_queue_idempotency_idx ON job_queue (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Idempotency records: outlive their job for a retention (7 days by default).
CREATE TABLE processed_keys (
    idempotency_key text PRIMARY KEY,
    job_id          uuid NOT NULL,
    job_type        text NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL
);
CREATE INDEX processed_keys_expires_idx ON processed_keys (expires_at);

-- Queues an operator paused; workers do not claim from them.
CREATE TABLE queues (
    name        text PRIMARY KEY,
    paused      boolean NOT NULL DEFAULT false,
    changed_at  timestamptz NOT NULL DEFAULT now(),
    changed_by  text
);

-- Resource leases for lock_key (the PostgreSQL lock backend). Token-fenced, expiring.
CREATE TABLE resource_locks (
    lock_key    text PRIMARY KEY,
    token       text NOT NULL,
    job_id      uuid,
    expires_at  timestamptz NOT NULL
);

-- Live workers, upserted on every heartbeat.
CREATE TABLE workers (
    id                 text PRIMARY KEY,
    host               text NOT NULL,
    pid                integer NOT NULL,
    queues             text[],
    tasks              text[] NOT NULL DEFAULT '{}',
    concurrency        integer NOT NULL,
    in_flight          integer NOT NULL DEFAULT 0,
    started_at         timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    stopped_at         timestamptz
);

-- Operator actions: who, from where, what, why.
CREATE TABLE audit_log (
    id          bigserial PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    os_user     text NOT NULL,
    ssh_client  text,
    action      text NOT NULL,
    queue       text,
    job_ids     uuid[] NOT NULL DEFAULT '{}',
    reason      text,
    detail      jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_log_at_idx ON audit_log (at DESC);

-- Per-minute counters per queue and job type, flushed by workers. They survive the retention of jobs.
CREATE TABLE job_metrics_minute (
    minute              timestamptz NOT NULL,
    queue               text NOT NULL,
    job_type            text NOT NULL,
    started             bigint NOT NULL DEFAULT 0,
    succeeded           bigint NOT NULL DEFAULT 0,
    failed              bigint NOT NULL DEFAULT 0,
    dead_lettered       bigint NOT NULL DEFAULT 0,
    retried             bigint NOT NULL DEFAULT 0,
    timeouts            bigint NOT NULL DEFAULT 0,
    anomalies           bigint NOT NULL DEFAULT 0,
    lock_contention     bigint NOT NULL DEFAULT 0,
    dedup_hits          bigint NOT NULL DEFAULT 0,
    idempotency_hits    bigint NOT NULL DEFAULT 0,
    lease_expirations   bigint NOT NULL DEFAULT 0,
    cancelled           bigint NOT NULL DEFAULT 0,
    latency_ms_sum      double precision NOT NULL DEFAULT 0,
    duration_ms_sum     double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, queue, job_type)
);

-- Wake idle workers on enqueue. One notification per statement, not per row, so batches stay cheap.
CREATE FUNCTION worker_core_notify_enqueue() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('worker_core_jobs', q) FROM (SELECT DISTINCT queue AS q FROM new_rows) s;
    RETURN NULL;
END $$;

CREATE TRIGGER job_queue_notify_insert
    AFTER INSERT ON job_queue
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION worker_core_notify_enqueue();
