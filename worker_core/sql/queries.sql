-- Every query worker_core runs, one named block each: "-- name: <name>" starts a block.
-- Parameters are psycopg named placeholders; "now" is always a parameter (worker_core.clock), but a producer's:
-- there NULL stands for the server's clock (worker_core.producer: a producer's host keeps its own time).
-- Identifiers are never interpolated: the only dynamic SQL is built with psycopg.sql in stats.py.

------------------------------------------------------------------------------------------------------
-- Producing
------------------------------------------------------------------------------------------------------

-- A scheduled_at in the past is stored as the statement's now: a not-before time already passed means due
-- now (queue latency, the console's lag and the claim order count from it; a job backdated to 2000 read as
-- 26 years of latency, and went ahead of every job enqueued before it).
-- name: insert_job
INSERT INTO job_queue (
    job_type, queue, payload, priority, max_attempts, scheduled_at, idempotency_key, dedup_key, lock_key,
    timeout_seconds, visibility_timeout_seconds, retry_policy, tenant_id, trace_id, created_at, updated_at)
SELECT %(job_type)s, %(queue)s, %(payload)s::jsonb, %(priority)s, %(max_attempts)s,
       greatest(coalesce(%(scheduled_at)s::timestamptz, t.now + make_interval(secs => %(delay)s::float8)), t.now),
       %(idempotency_key)s, %(dedup_key)s, %(lock_key)s, %(timeout_seconds)s, %(visibility_timeout_seconds)s,
       %(retry_policy)s::jsonb, %(tenant_id)s, %(trace_id)s, t.now, t.now
FROM (SELECT coalesce(%(now)s::timestamptz, statement_timestamp()) AS now) AS t
ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL AND state IN ('queued', 'running', 'retry_scheduled')
DO NOTHING
RETURNING id;

-- name: insert_jobs_many
INSERT INTO job_queue (
    job_type, queue, payload, priority, max_attempts, scheduled_at, idempotency_key, dedup_key, lock_key,
    timeout_seconds, visibility_timeout_seconds, retry_policy, tenant_id, trace_id, created_at, updated_at)
SELECT t.job_type, t.queue, t.payload, t.priority, t.max_attempts,
       greatest(coalesce(t.scheduled_at, n.now + make_interval(secs => t.delay)), n.now), t.idempotency_key,
       t.dedup_key, t.lock_key, t.timeout_seconds, t.visibility_timeout_seconds, t.retry_policy,
       t.tenant_id, t.trace_id, n.now, n.now
FROM (SELECT coalesce(%(now)s::timestamptz, statement_timestamp()) AS now) AS n, unnest(
    %(job_type)s::text[], %(queue)s::text[], %(payload)s::jsonb[], %(priority)s::int[], %(max_attempts)s::int[],
    %(scheduled_at)s::timestamptz[], %(delay)s::float8[], %(idempotency_key)s::text[], %(dedup_key)s::text[],
    %(lock_key)s::text[], %(timeout_seconds)s::float8[], %(visibility_timeout_seconds)s::float8[],
    %(retry_policy)s::jsonb[], %(tenant_id)s::text[], %(trace_id)s::text[]
) AS t(job_type, queue, payload, priority, max_attempts, scheduled_at, delay, idempotency_key, dedup_key, lock_key,
       timeout_seconds, visibility_timeout_seconds, retry_policy, tenant_id, trace_id)
ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL AND state IN ('queued', 'running', 'retry_scheduled')
DO NOTHING
RETURNING id, dedup_key;

-- name: live_by_dedup_keys
SELECT id, dedup_key FROM job_queue
WHERE dedup_key = ANY(%(keys)s) AND state IN ('queued', 'running', 'retry_scheduled');

------------------------------------------------------------------------------------------------------
-- The claims. Each lane is FOR UPDATE SKIP LOCKED in (priority, scheduled_at, id) order, MATERIALIZED
-- so the planner cannot re-run the LIMIT subquery and lock more rows than asked (see Oban's fetch_jobs).
-- Paused queues and limited types come as parameters the worker refreshes on every heartbeat (a pause or
-- an operator's new limit takes effect within one heartbeat): subqueries here wreck the planner's row
-- estimates, and it then sorts every ready job instead of walking the ready index.
--
-- claim: ready jobs, many at once, never suspects.
-- claim_solo: for a worker with nothing in flight, one job: a running job whose lease expired (its
--   worker died or froze), or a suspect waiting. It then runs alone, so if it kills its process again
--   nobody else pays. An expired job that already ran alone and has no attempts left goes to
--   dead_lettered here without running its payload again (poison pill); one an operator asked to kill
--   goes to cancelled. An expired job that shared its process gets one more attempt: it may be innocent.
------------------------------------------------------------------------------------------------------

-- name: fragment_claimed_columns
-- What a worker needs of a claimed job, and no more: each column is decoded into each claimed job's dict
-- (a third of the claimer's time in no-op drains). Not the errors history, which can be long.
j.id, j.job_type, j.queue, j.payload, j.state, j.priority, j.attempts, j.max_attempts, j.scheduled_at,
j.idempotency_key, j.lock_key, j.timeout_seconds, j.visibility_timeout_seconds,
j.retry_policy::text AS retry_policy, j.tenant_id, j.trace_id, j.ran_solo

-- name: fragment_claim_ready
-- The rows of a `ready` CTE become running, held by this worker, at their next attempt. Found by id
-- through the primary key: a plan that cannot know the LIMIT (the prepared claim's generic plan) would
-- otherwise expect thousands of ready rows and join them by hashing the whole table.
UPDATE job_queue j SET
    state = 'running',
    attempts = j.attempts + 1,
    locked_by = %(worker)s,
    locked_until = %(now)s + make_interval(secs => j.visibility_timeout_seconds),
    started_at = %(now)s,
    ran_solo = false,
    updated_at = %(now)s
WHERE j.id = ANY(ARRAY(SELECT id FROM ready))
RETURNING {{claimed_columns}}, false AS reclaimed

-- name: fragment_full_limits
-- For the solo lane (claim_solo, solo_work_waiting), which has no advisory lock of its own: the (job_type,
-- scope) limits with no room left, worked out once per statement (a MATERIALIZED CTE, not a count per
-- candidate row: held expired leases stay running, and each heartbeat walked past all of them). Counts the
-- jobs running with a live lease (a reclaimed expired one does not add to them). `limits` is the worker's
-- list of (job_type, scope, max_running) as JSON. Without it `limit T 0` did not hold T's suspects and
-- expired leases: the very jobs that crash processes, during the incident the limit contains.
full_limits AS MATERIALIZED (
    SELECT l.job_type, l.scope
    FROM jsonb_to_recordset(%(limits)s::jsonb) AS l(job_type text, scope text, max_running int)
    WHERE (SELECT count(*) FROM job_queue r
           WHERE r.state = 'running' AND r.locked_until >= %(now)s AND r.job_type = l.job_type
             AND (l.scope = '*' OR r.queue = l.scope)) >= l.max_running
)

-- name: fragment_limit_full
-- A job_queue row whose type's limit has no room (full_limits).
SELECT 1 FROM full_limits f WHERE f.job_type = job_queue.job_type AND f.scope IN ('*', job_queue.queue)

-- name: claim_session
-- The claim connection's settings: its statements are planned with each call's parameters (see
-- Worker._conn_for_claims), but for the main claim (claim_run). The plans' row estimates come from the
-- statistics of migration 0008.
SET plan_cache_mode = force_custom_plan;

-- name: claim_run
-- The main claim, prepared by Worker._claim_ready as worker_core_claim(now, limit) with the worker's
-- filters as literals: run with its generic plan; an idle worker's claim commits without waiting for the
-- WAL flush (sync 'off': why that is safe, Worker._claim_ready). Sent as one simple query: the settings
-- hold for its transaction only.
SELECT set_config('plan_cache_mode', 'force_generic_plan', true), set_config('synchronous_commit', %(sync)s, true);
EXECUTE worker_core_claim(%(now)s, %(limit)s);

-- name: claim
WITH ready AS MATERIALIZED (
    SELECT id FROM job_queue
    WHERE state IN ('queued', 'retry_scheduled') AND scheduled_at <= %(now)s AND NOT suspect
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
      AND job_type = ANY(%(job_types)s)
      AND queue <> ALL(%(paused)s::text[])
      AND job_type <> ALL(%(limited_types)s::text[])
      AND job_type || ' ' || queue <> ALL(%(limited_pairs)s::text[])
    ORDER BY priority, scheduled_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
{{claim_ready}};

-- name: claim_solo
WITH {{full_limits}}, expired AS MATERIALIZED (
    SELECT id FROM job_queue
    WHERE state = 'running' AND locked_until < %(now)s
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
      AND job_type = ANY(%(job_types)s)
      -- a pause or a limit holds what would run again, not the end of a killed job or a poison pill
      AND (cancel_requested OR (ran_solo AND attempts >= max_attempts)
           OR (queue <> ALL(%(paused)s::text[]) AND NOT EXISTS ({{limit_full}})))
    ORDER BY locked_until
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), suspects AS MATERIALIZED (
    SELECT id FROM job_queue
    WHERE suspect AND state IN ('queued', 'retry_scheduled') AND scheduled_at <= %(now)s
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
      AND job_type = ANY(%(job_types)s)
      AND queue <> ALL(%(paused)s::text[])
      AND NOT EXISTS ({{limit_full}})
      AND NOT EXISTS (SELECT 1 FROM expired)
    ORDER BY priority, scheduled_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), decided AS (
    SELECT j.id, (j.state = 'running') AS expired,
           CASE WHEN j.state = 'running' AND j.cancel_requested THEN 'cancelled'
                WHEN j.state = 'running' AND j.ran_solo AND j.attempts >= j.max_attempts THEN 'dead_lettered'
                ELSE 'running' END AS next_state
    FROM job_queue j
    WHERE j.id IN (SELECT id FROM expired UNION ALL SELECT id FROM suspects)
)
UPDATE job_queue j SET
    state = d.next_state,
    attempts = j.attempts + (d.next_state = 'running')::int,
    -- a lease lost while sharing a process is not proof of guilt: the job always gets a run alone, one more
    -- attempt if it had none left. The lost one still counts (its budget does not grow by it): a payload
    -- that kills its process then costs max_attempts restarts at most, and a bystander that had attempts
    -- left has one fewer of its own (a rare loss, where a process died of another job)
    max_attempts = CASE WHEN d.expired AND NOT j.ran_solo AND d.next_state = 'running'
                        THEN greatest(j.max_attempts, j.attempts + 1) ELSE j.max_attempts END,
    locked_by = CASE WHEN d.next_state = 'running' THEN %(worker)s ELSE j.locked_by END,
    locked_until = CASE WHEN d.next_state = 'running'
                        THEN %(now)s + make_interval(secs => j.visibility_timeout_seconds) END,
    started_at = CASE WHEN d.next_state = 'running' THEN %(now)s ELSE j.started_at END,
    finished_at = CASE WHEN d.next_state = 'running' THEN NULL ELSE %(now)s END,
    lease_expirations = j.lease_expirations + d.expired::int,
    suspect = d.next_state = 'running',
    ran_solo = d.next_state = 'running',
    errors = CASE WHEN d.expired THEN j.errors || jsonb_build_array(jsonb_build_object(
                 'attempt', j.attempts, 'kind', 'lease_expired', 'class', 'LeaseExpired',
                 'message', 'lease expired: worker ' || coalesce(j.locked_by, '?') || ' died or froze'
                            || CASE WHEN j.ran_solo THEN ' running this job alone' ELSE '' END,
                 'worker', j.locked_by, 'at', %(now)s))
             ELSE j.errors END,
    last_error = CASE WHEN d.expired
                      THEN 'LeaseExpired: lease expired: worker ' || coalesce(j.locked_by, '?') || ' died or froze'
                           || CASE WHEN j.ran_solo THEN ' running this job alone' ELSE '' END
                      ELSE j.last_error END,
    error_fingerprint = CASE WHEN d.expired
                             THEN 'LeaseExpired: lease expired: worker <*> died or froze'
                                  || CASE WHEN j.ran_solo THEN ' running this job alone' ELSE '' END
                             ELSE j.error_fingerprint END,
    cancel_requested = j.cancel_requested AND d.next_state <> 'cancelled',
    updated_at = %(now)s
FROM decided d
WHERE j.id = d.id
RETURNING {{claimed_columns}}, d.expired AS reclaimed;

-- name: claimed_unheard
-- The jobs a claim of this worker made running whose answer never came back: the connection broke after
-- the claim committed (a network cut, a proxy, a failover that kept the commit). Only this worker's, not
-- known to it, started (by its clock) since that claim began, their lease still live: an expired one is
-- for the lease path (claim_solo), which another worker may be taking it by already.
SELECT {{claimed_columns}}, false AS reclaimed FROM job_queue j
WHERE j.state = 'running' AND j.locked_by = %(worker)s AND j.started_at >= %(since)s
  AND j.locked_until > %(now)s AND j.id <> ALL(%(known)s::uuid[])
ORDER BY j.priority, j.scheduled_at, j.id;

-- name: claim_limited
-- One limited (job type, queue scope) at a time, serialized by advisory locks: count what runs, claim at
-- most the difference. A type's '*' limit caps all its queues together, a queue's own limit that queue
-- (both apply: `type_max` is the '*' limit when claiming for a queue's own). Run in a transaction after
-- `limit_lock` on the type's '*' scope (if limited) and then on each of its queue scopes, in that order.
-- The '*' pass takes the queues without a limit of their own; the queue passes take theirs.
WITH running AS (
    SELECT count(*) FILTER (WHERE %(scope)s = '*' OR queue = %(scope)s) AS here, count(*) AS everywhere
    FROM job_queue WHERE state = 'running' AND job_type = %(job_type)s
), ready AS MATERIALIZED (
    SELECT id FROM job_queue
    WHERE state IN ('queued', 'retry_scheduled') AND scheduled_at <= %(now)s AND NOT suspect
      AND job_type = %(job_type)s AND (%(scope)s = '*' OR queue = %(scope)s)
      AND NOT (%(scope)s = '*' AND EXISTS (SELECT 1 FROM concurrency_limits l
                                         WHERE l.job_type = job_queue.job_type AND l.queue = job_queue.queue))
      AND (%(all_queues)s OR queue = ANY(%(queues)s))
      AND queue <> ALL(%(paused)s::text[])
    ORDER BY priority, scheduled_at, id
    LIMIT greatest(0, least(%(limit)s, %(max_running)s - (SELECT here FROM running),
                            coalesce(%(type_max)s::int, 2147483647) - (SELECT everywhere FROM running)))
    FOR UPDATE SKIP LOCKED
)
{{claim_ready}};

-- name: job_type_known
-- A type a worker registered (job_type_contracts), or that has a job: what a limit may name.
SELECT EXISTS (SELECT 1 FROM job_type_contracts WHERE job_type = %(job_type)s)
    OR EXISTS (SELECT 1 FROM job_queue WHERE job_type = %(job_type)s) AS known;

-- name: queue_known
-- A queue paused or resumed before, one a worker registered a type in or listens to, or one a job has: what
-- pause and resume may name. With it, the queues paused now (for the message when it is not known).
SELECT (EXISTS (SELECT 1 FROM queues WHERE name = %(queue)s)
        OR EXISTS (SELECT 1 FROM job_type_contracts WHERE queue = %(queue)s)
        OR EXISTS (SELECT 1 FROM workers WHERE stopped_at IS NULL AND %(queue)s = ANY(queues))
        OR EXISTS (SELECT 1 FROM job_queue WHERE queue = %(queue)s)) AS known,
       ARRAY(SELECT name FROM queues WHERE paused ORDER BY name) AS paused;

-- name: limit_lock
SELECT pg_advisory_xact_lock(hashtext('qconsole-limit:' || %(job_type)s || ':' || %(scope)s));

-- name: limits_for_types
-- A type's '*' limit and its queues' own limits: both apply (claim_limited).
SELECT job_type, queue AS scope, max_running FROM concurrency_limits WHERE job_type = ANY(%(job_types)s)
ORDER BY job_type, queue;

-- name: fragment_limit_set_by
-- Who set the concurrency_limits row `l` (an operator's): its audit entry, written in the same transaction at the
-- same time (an index lookup on audit_log's time; a limit a @task declares has none).
(SELECT a.os_user || coalesce('@' || a.ssh_client, '') FROM audit_log a
 WHERE a.at = l.updated_at AND a.action = 'limit' AND a.detail ->> 'job_type' = l.job_type
   AND a.detail ->> 'queue' = l.queue
 ORDER BY a.id DESC LIMIT 1)

-- name: limits_list
-- With who set an operator's limit (fragment_limit_set_by).
SELECT l.job_type, l.queue, l.max_running, l.source, l.reason, l.updated_at, {{limit_set_by}} AS set_by
FROM concurrency_limits l
ORDER BY l.job_type, l.queue;

-- name: limit_set
INSERT INTO concurrency_limits (job_type, queue, max_running, source, reason, updated_at)
VALUES (%(job_type)s, %(queue)s, %(max_running)s, %(source)s, %(reason)s, %(now)s)
ON CONFLICT (job_type, queue) DO UPDATE SET max_running = EXCLUDED.max_running, source = EXCLUDED.source,
    reason = EXCLUDED.reason, updated_at = EXCLUDED.updated_at
RETURNING job_type;

-- name: limit_current
-- The limit an operator's change replaces, locked for the change (none: no row to lock; of two changes made at
-- the same instant to a type with none, the later wins).
SELECT max_running, source, reason, updated_at FROM concurrency_limits
WHERE job_type = %(job_type)s AND queue = %(queue)s
FOR UPDATE;

-- name: limit_clear
DELETE FROM concurrency_limits WHERE job_type = %(job_type)s AND queue = %(queue)s
RETURNING job_type, source, max_running;

-- name: limit_drop_from_task
-- A worker's types whose @task no longer declares a limit: the one an earlier version declared goes (an
-- operator's stays). During a rolling deploy the old and new workers put it back and take it away.
DELETE FROM concurrency_limits WHERE source = 'task' AND queue = '*' AND job_type = ANY(%(job_types)s);

-- name: limit_set_from_task
-- A worker declares its @task limits; an operator's limit (source 'operator') is not overwritten.
INSERT INTO concurrency_limits (job_type, queue, max_running, source, reason, updated_at)
VALUES (%(job_type)s, '*', %(max_running)s, 'task', %(reason)s, %(now)s)
ON CONFLICT (job_type, queue) DO UPDATE SET max_running = EXCLUDED.max_running, updated_at = EXCLUDED.updated_at,
    reason = EXCLUDED.reason
    WHERE concurrency_limits.source = 'task';

-- name: solo_work_waiting
-- What claim_solo would find (the same filters, paused queues included): else a worker would stop claiming
-- to drain for a solo claim that finds nothing, on every heartbeat.
WITH {{full_limits}}
SELECT EXISTS (
    SELECT 1 FROM job_queue
    WHERE state = 'running' AND locked_until < %(now)s
      AND (%(all_queues)s OR queue = ANY(%(queues)s)) AND job_type = ANY(%(job_types)s)
      AND (cancel_requested OR (ran_solo AND attempts >= max_attempts)
           OR (queue <> ALL(%(paused)s::text[]) AND NOT EXISTS ({{limit_full}})))
) OR EXISTS (
    SELECT 1 FROM job_queue
    WHERE suspect AND state IN ('queued', 'retry_scheduled') AND scheduled_at <= %(now)s
      AND (%(all_queues)s OR queue = ANY(%(queues)s)) AND job_type = ANY(%(job_types)s)
      AND queue <> ALL(%(paused)s::text[])
      AND NOT EXISTS ({{limit_full}})
) AS waiting;

------------------------------------------------------------------------------------------------------
-- Running and settling. Every state change from running is fenced: the row must still be running,
-- held by this worker, at this attempt. Zero rows means a rescuer took it: not an error, roll back.
--
-- Lock order: a statement that changes many jobs at once while others may (a batch or group
-- settlement, a kill, a requeue, giving surplus back, ending a dead worker's leases) first locks
-- its rows in id order, in a MATERIALIZED "... ORDER BY id FOR NO KEY UPDATE" (the lock its UPDATE takes
-- anyway; requeue_jobs' FOR UPDATE, as it was), then updates them found by id. An UPDATE locks in the order
-- its plan reads: a few ids through the primary key (id order), more through a bitmap scan (the heap's
-- order), so a group settlement and its worker's heartbeat, or a kill and a heartbeat, deadlocked; a
-- group's loss ran its handlers again. Claims, prunes and the heartbeat skip locked rows and never wait
-- on them.
------------------------------------------------------------------------------------------------------

-- name: heartbeat_jobs
-- The leases of this worker's jobs: those running and those waiting for the completer to settle them. A
-- row another transaction has locked is not waited for (so the beat never takes part in a deadlock, and
-- needs no lock order, see "Lock order" above): an operator's open transaction on one row held up the whole
-- beat (every other lease, the worker's own row) until the statement timeout, and the completer's
-- settlement, waiting behind such a lock, holds the rows of its batch it came to. Such a row, still this
-- worker's in the statement's snapshot, comes back with extended false: neither extended nor lost this beat
-- (while it is locked no claim can take it either). Through the primary key, not the running index (see
-- settle_succeeded_many).
WITH ours AS MATERIALIZED (
    SELECT id FROM job_queue
    WHERE id = ANY(%(ids)s::uuid[]) AND (state = 'running') IS TRUE AND locked_by = %(worker)s
    FOR NO KEY UPDATE SKIP LOCKED
), extended AS (
    UPDATE job_queue j SET
        locked_until = %(now)s + make_interval(secs => j.visibility_timeout_seconds),
        updated_at = %(now)s
    WHERE j.id = ANY(ARRAY(SELECT id FROM ours))
    RETURNING j.id, j.attempts, j.cancel_requested
)
SELECT id, attempts, cancel_requested, true AS extended FROM extended
UNION ALL
SELECT id, attempts, cancel_requested, false FROM job_queue
WHERE id = ANY(%(ids)s::uuid[]) AND (state = 'running') IS TRUE AND locked_by = %(worker)s
  AND id NOT IN (SELECT id FROM ours);

-- name: record_processed_key
INSERT INTO processed_keys (idempotency_key, job_id, job_type, processed_at, expires_at)
VALUES (%(key)s, %(job_id)s, %(job_type)s, %(now)s, %(now)s + make_interval(secs => %(retention_seconds)s))
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING job_id;

-- name: record_group_key
-- record_processed_key for one job of a group, its values written in by the worker as quoted literals, in
-- the same simple-protocol round trip as the job's SAVEPOINT (Slot._open_with_key). Not a PREPAREd
-- statement: psycopg deallocates every prepared statement of the session when it rolls back a transaction
-- in which it had prepared its own, and the next EXECUTE would fail.
INSERT INTO processed_keys (idempotency_key, job_id, job_type, processed_at, expires_at)
VALUES (%(key)s, %(job_id)s::uuid, %(job_type)s, %(now)s::timestamptz,
        %(now)s::timestamptz + make_interval(secs => %(retention_seconds)s))
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING job_id;

-- name: record_group_keys
-- The idempotency records of a group's jobs, in one statement at the start of its transaction (worker.
-- Slot._record_group_keys), each row written in by the worker as quoted literals: (key, job id, type).
-- In key order, so that two groups wanting the same keys wait for each other rather than deadlock. A key
-- not returned was processed already (a hit). A job that fails has its record deleted with its rollback.
INSERT INTO processed_keys (idempotency_key, job_id, job_type, processed_at, expires_at)
SELECT k, id::uuid, t, %(now)s, %(now)s::timestamptz + make_interval(secs => %(retention_seconds)s)
FROM (VALUES %(rows)s) AS v(k, id, t)
ORDER BY k
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING job_id;

-- name: forget_group_key
-- A grouped job that failed or was cancelled gives back the idempotency record its group wrote for it.
DELETE FROM processed_keys WHERE idempotency_key = %(key)s AND job_id = %(job_id)s;

-- name: unrecord_group_keys
-- A handler ended its group's transaction itself (Slot._unrecord_waiting): the records the group wrote for
-- the jobs not begun yet are deleted, and those jobs record their keys one by one.
DELETE FROM processed_keys WHERE job_id = ANY(%(ids)s::uuid[]);

-- name: terminate_backends
-- The server processes of an abandoned slot's connections (Slot.end_abandoned_backends): ending them rolls
-- back the stuck handler's transaction and frees its locks. Only connections of this session's user to
-- this database (a worker's own), never the caller's.
SELECT pid, pg_terminate_backend(pid) AS terminated
FROM pg_stat_activity
WHERE pid = ANY(%(pids)s::integer[])
  AND pid <> pg_backend_pid()
  AND datname = current_database()
  AND usename = session_user;

-- name: processed_key_owner
SELECT job_id FROM processed_keys WHERE idempotency_key = %(key)s;

-- name: settle_succeeded
-- Every statement that settles or releases named running jobs says "(state = 'running') IS TRUE": through
-- the primary key, never the running index (see settle_succeeded_many).
-- A job an operator killed is refused its success, in the transaction of its effects, which roll back: the
-- kill is final (it gave the job's dedup key away, to an equivalent message that then runs), and the worker
-- settles it cancelled (Slot.settle_refused). A kill that comes after this statement waits for its row
-- lock, and finds the job settled.
UPDATE job_queue SET
    state = 'succeeded', finished_at = %(now)s, locked_until = NULL, updated_at = %(now)s
WHERE id = %(id)s AND (state = 'running') IS TRUE AND attempts = %(attempt)s AND locked_by = %(worker)s
  AND NOT cancel_requested
RETURNING id;

-- name: settle_succeeded_many
-- The batch completer: jobs whose handler wrote nothing through ctx.tx and carry no idempotency key have
-- no effect to commit with their settlement, so many settle in one statement. Fenced per job.
-- ids and fences ('<id>/<attempt>') come as array literals (text): psycopg's per-element list adaptation
-- cost more than the statement for batches of hundreds. The fences are matched by hashing.
-- Found through the primary key. "(state = 'running') IS TRUE" says "state = 'running'" in a form the
-- planner cannot match to the running index: between vacuums that index holds mostly dead entries of
-- the jobs settled since, which its statistics do not count, and reading it cost 76 ms per settlement
-- of 450 jobs in a 40,000-job drain (5 ms through the primary key).
-- Rows locked in id order first (see "Lock order" above heartbeat_jobs).
WITH held AS MATERIALIZED (
    SELECT j.id FROM job_queue j
    WHERE {{ours_to_settle}}
    ORDER BY j.id FOR NO KEY UPDATE
)
{{settled_succeeded}};

-- name: fragment_ours_to_settle
-- the jobs of ids still running under this worker at their attempts (fences), not killed: settle_succeeded's
-- fence, per job
j.id = ANY(%(ids)s::uuid[]) AND (j.state = 'running') IS TRUE AND j.locked_by = %(worker)s
      AND j.id::text || '/' || j.attempts = ANY(%(fences)s::text[]) AND NOT j.cancel_requested

-- name: fragment_settled_succeeded
UPDATE job_queue j SET
    state = 'succeeded', finished_at = %(now)s, locked_until = NULL, updated_at = %(now)s, suspect = false
WHERE j.id = ANY(ARRAY(SELECT id FROM held))
RETURNING j.id

-- name: settle_group
-- settle_succeeded_many for a group's commit (Slot._commit_group), waiting at most lock_wait (ms, text) for a
-- row another transaction holds: behind an operator's open transaction on one job's row it waited as long as
-- that stayed open, and held meanwhile its slot, the group's idempotency records and the rows its handlers
-- wrote (whatever needed those waited too). Past the bound it fails (LockNotAvailable) and the group is
-- rolled back and given back (Slot._held_up). The bound is set before the first row is locked (the held
-- CTE's one-time condition) and the transaction's own lock_timeout (a handler's SET LOCAL, for its deferred
-- triggers at COMMIT) is put back after the rows are settled.
WITH bound AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS was, set_config('lock_timeout', %(lock_wait)s, true) AS bound
), held AS MATERIALIZED (
    SELECT j.id FROM job_queue j
    WHERE {{ours_to_settle}}
      AND (SELECT bound IS NOT NULL FROM bound)
    ORDER BY j.id FOR NO KEY UPDATE
), settled AS (
    {{settled_succeeded}}
)
SELECT id FROM settled WHERE set_config('lock_timeout', (SELECT was FROM bound), true) IS NOT NULL;

-- name: rows_held_elsewhere
-- Of ids, those whose row another transaction holds locked now (Slot._held_up): the others are locked a moment
-- and let go with the transaction.
SELECT id FROM unnest(%(ids)s::uuid[]) AS t(id)
WHERE id NOT IN (SELECT j.id FROM job_queue j WHERE j.id = ANY(%(ids)s::uuid[]) FOR NO KEY UPDATE SKIP LOCKED);

-- name: bound_lock_wait
-- For the rest of the transaction, a lock is waited for lock_wait (ms, text) at most (Slot._write, after a
-- group was held up).
SELECT set_config('lock_timeout', %(lock_wait)s, true);

-- name: settle_succeeded_available
-- settle_succeeded_many for the completer (Completer._flush), waiting on no row lock: a row another
-- transaction holds (an operator's open transaction, a kill on its way) is skipped and tried again with the
-- next batch (settle_still_ours tells it from a job no longer this worker's). Waiting, the completer held
-- the rows of its batch it had come to, which the heartbeat (that skips locked rows) could not extend.
WITH held AS MATERIALIZED (
    SELECT j.id FROM job_queue j
    WHERE j.id = ANY(%(ids)s::uuid[]) AND (j.state = 'running') IS TRUE AND j.locked_by = %(worker)s
      AND j.id::text || '/' || j.attempts = ANY(%(fences)s::text[]) AND NOT j.cancel_requested
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE job_queue j SET
    state = 'succeeded', finished_at = %(now)s, locked_until = NULL, updated_at = %(now)s, suspect = false
WHERE j.id = ANY(ARRAY(SELECT id FROM held))
RETURNING j.id;

-- name: settle_still_ours
-- Of the jobs settle_succeeded_available did not settle, those still running under this worker at the same
-- attempt, not killed: their rows were locked by another transaction (in its snapshot: a kill that has not
-- committed yet shows here, and is found killed next time).
SELECT j.id FROM job_queue j
WHERE j.id = ANY(%(ids)s::uuid[]) AND (j.state = 'running') IS TRUE AND j.locked_by = %(worker)s
  AND j.id::text || '/' || j.attempts = ANY(%(fences)s::text[]) AND NOT j.cancel_requested;

-- name: settled_here
-- Of ids, the jobs already settled succeeded by this worker at their attempts (fences): a settlement of its own
-- whose COMMIT went through and whose answer was lost with the connection (the server restarted, the network
-- cut between the commit and its answer), found when the settlement, or the release that follows a lost
-- group, is tried again (Completer._flush, Slot._write). Nothing else leaves a row 'succeeded' with this
-- worker's locked_by at that attempt: a settlement keeps both, a takeover changes both (the claim writes its
-- worker and the next attempt), a requeue clears locked_by. Through the primary key (see settle_succeeded_many).
SELECT j.id FROM job_queue j
WHERE j.id = ANY(%(ids)s::uuid[]) AND (j.state = 'succeeded') IS TRUE AND j.locked_by = %(worker)s
  AND j.id::text || '/' || j.attempts = ANY(%(fences)s::text[]);

-- name: settle_error
-- A job an operator killed while it ran, which failed before the worker saw the kill, ends cancelled (its
-- error recorded): not retried, and not failed or dead-lettered either, where a replay of its dead-letter
-- group would run it again. RETURNING the state written.
UPDATE job_queue SET
    state = CASE WHEN cancel_requested AND %(state)s IN ('retry_scheduled', 'failed', 'dead_lettered')
                 THEN 'cancelled' ELSE %(state)s END,
    scheduled_at = CASE WHEN %(state)s = 'retry_scheduled' AND NOT cancel_requested THEN %(scheduled_at)s
                        ELSE scheduled_at END,
    finished_at = CASE WHEN %(state)s = 'retry_scheduled' AND NOT cancel_requested THEN NULL ELSE %(now)s END,
    locked_until = NULL,
    errors = errors || jsonb_build_array(%(error)s::jsonb),
    last_error = %(last_error)s,
    error_fingerprint = %(fingerprint)s,
    cancel_requested = false,
    suspect = false,
    updated_at = %(now)s
WHERE id = %(id)s AND (state = 'running') IS TRUE AND attempts = %(attempt)s AND locked_by = %(worker)s
RETURNING id, state;

-- name: release_job
-- Give a claimed job back without counting the attempt: shutdown before it finished, or lock contention.
-- Never a job an operator killed meanwhile: the worker settles that one cancelled instead.
UPDATE job_queue SET
    state = 'queued', attempts = attempts - 1, locked_by = NULL, locked_until = NULL,
    scheduled_at = %(scheduled_at)s, started_at = NULL, updated_at = %(now)s
WHERE id = %(id)s AND (state = 'running') IS TRUE AND attempts = %(attempt)s AND locked_by = %(worker)s
  AND NOT cancel_requested
RETURNING id;

-- name: release_surplus
-- Jobs a claim brought beyond what the worker's slots and prefetch can take (Worker._keep_within): back to
-- queued at once, the attempt not counted, for any worker to claim. Not one an operator killed meanwhile:
-- the worker keeps it, and settles it cancelled without running it (as any job killed in its buffer).
WITH held AS MATERIALIZED (
    SELECT j.id FROM job_queue j
    WHERE j.id = ANY(%(ids)s::uuid[]) AND (j.state = 'running') IS TRUE AND j.locked_by = %(worker)s
      AND NOT j.cancel_requested
    ORDER BY j.id FOR NO KEY UPDATE
)
UPDATE job_queue j SET
    state = 'queued', attempts = j.attempts - 1, locked_by = NULL, locked_until = NULL, started_at = NULL,
    updated_at = %(now)s
WHERE j.id = ANY(ARRAY(SELECT id FROM held))
RETURNING j.id;

-- name: expire_worker_leases
-- A supervisor saw its child die: its leases end now, so any worker reclaims them at once.
WITH held AS MATERIALIZED (
    SELECT id FROM job_queue WHERE state = 'running' AND locked_by = ANY(%(workers)s)
    ORDER BY id FOR NO KEY UPDATE
)
UPDATE job_queue SET locked_until = %(now)s - interval '1 millisecond', updated_at = %(now)s
WHERE id = ANY(ARRAY(SELECT id FROM held))
RETURNING id;

-- name: release_locks_of_jobs
-- ... and, in the same transaction, the lock_key leases those jobs held (PostgreSQL backend): else the
-- reclaimed job found its own lock taken and was rescheduled for contention until it ran out.
DELETE FROM resource_locks WHERE job_id = ANY(%(jobs)s);

------------------------------------------------------------------------------------------------------
-- lock_key leases (PostgreSQL backend): token-fenced, expiring, so a dead holder frees it by itself. "now" NULL:
-- the server's clock (worker_core.clock.statement_now), as for single_flight's results below.
------------------------------------------------------------------------------------------------------

-- name: lock_acquire
INSERT INTO resource_locks (lock_key, token, job_id, expires_at)
VALUES (%(key)s, %(token)s, %(job_id)s, coalesce(%(now)s::timestamptz, statement_timestamp()) + make_interval(secs => %(ttl)s))
ON CONFLICT (lock_key) DO UPDATE
    SET token = EXCLUDED.token, job_id = EXCLUDED.job_id, expires_at = EXCLUDED.expires_at
    WHERE resource_locks.expires_at < coalesce(%(now)s::timestamptz, statement_timestamp()) OR resource_locks.token = EXCLUDED.token
RETURNING token;

-- name: lock_extend
UPDATE resource_locks SET expires_at = coalesce(%(now)s::timestamptz, statement_timestamp()) + make_interval(secs => %(ttl)s)
WHERE lock_key = %(key)s AND token = %(token)s
RETURNING lock_key;

-- name: lock_release
DELETE FROM resource_locks WHERE lock_key = %(key)s AND token = %(token)s RETURNING lock_key;

-- name: lock_holder
SELECT lock_key, token, job_id, expires_at FROM resource_locks WHERE lock_key = %(key)s;

------------------------------------------------------------------------------------------------------
-- Workers and metrics
------------------------------------------------------------------------------------------------------

-- name: worker_upsert
INSERT INTO workers (id, host, pid, queues, tasks, concurrency, in_flight, started_at, last_heartbeat_at,
                     heartbeat_interval_seconds)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(tasks)s, %(concurrency)s, %(in_flight)s, %(now)s, %(now)s,
        %(heartbeat_interval)s)
ON CONFLICT (id) DO UPDATE SET
    in_flight = EXCLUDED.in_flight, last_heartbeat_at = EXCLUDED.last_heartbeat_at, stopped_at = NULL,
    heartbeat_interval_seconds = EXCLUDED.heartbeat_interval_seconds
RETURNING clock_timestamp() AS db_now;  -- the server's clock, to compare the worker's with (Worker._check_clock)

-- name: workers_of_process
-- The worker rows of one process not yet stopped (a process a console started knows its pid, not its id).
SELECT id FROM workers WHERE host = %(host)s AND pid = %(pid)s AND stopped_at IS NULL;

-- name: worker_stopped
UPDATE workers SET stopped_at = %(now)s, in_flight = 0, last_heartbeat_at = %(now)s WHERE id = %(id)s;

-- name: workers_prune
DELETE FROM workers WHERE last_heartbeat_at < %(before)s;

-- name: metrics_flush
INSERT INTO job_metrics_minute AS m (
    minute, queue, job_type, started, succeeded, failed, dead_lettered, retried, timeouts, anomalies,
    lock_contention, dedup_hits, idempotency_hits, lease_expirations, cancelled, latency_ms_sum, duration_ms_sum)
SELECT minute, queue, job_type, started, succeeded, failed, dead_lettered, retried, timeouts, anomalies,
       lock_contention, dedup_hits, idempotency_hits, lease_expirations, cancelled, latency_ms_sum, duration_ms_sum
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(
    minute timestamptz, queue text, job_type text, started bigint, succeeded bigint, failed bigint,
    dead_lettered bigint, retried bigint, timeouts bigint, anomalies bigint, lock_contention bigint,
    dedup_hits bigint, idempotency_hits bigint, lease_expirations bigint, cancelled bigint,
    latency_ms_sum float8, duration_ms_sum float8)
ORDER BY minute, queue, job_type
ON CONFLICT (minute, queue, job_type) DO UPDATE SET
    started = m.started + EXCLUDED.started,
    succeeded = m.succeeded + EXCLUDED.succeeded,
    failed = m.failed + EXCLUDED.failed,
    dead_lettered = m.dead_lettered + EXCLUDED.dead_lettered,
    retried = m.retried + EXCLUDED.retried,
    timeouts = m.timeouts + EXCLUDED.timeouts,
    anomalies = m.anomalies + EXCLUDED.anomalies,
    lock_contention = m.lock_contention + EXCLUDED.lock_contention,
    dedup_hits = m.dedup_hits + EXCLUDED.dedup_hits,
    idempotency_hits = m.idempotency_hits + EXCLUDED.idempotency_hits,
    lease_expirations = m.lease_expirations + EXCLUDED.lease_expirations,
    cancelled = m.cancelled + EXCLUDED.cancelled,
    latency_ms_sum = m.latency_ms_sum + EXCLUDED.latency_ms_sum,
    duration_ms_sum = m.duration_ms_sum + EXCLUDED.duration_ms_sum
-- the transaction's id: if the reply to its COMMIT is lost, the next flush asks whether it committed
RETURNING pg_current_xact_id()::text AS xid;

-- name: xact_status
SELECT pg_xact_status(%(xid)s::xid8) AS status;

-- name: lock_wait_bound
-- For the rest of this transaction, a statement waits this long at most for a lock (LockNotAvailable after):
-- ops.lock_wait_bounded, around an operator action's statements on audit_log, queues, concurrency_limits.
-- With the setting it replaces, put back after (lock_wait_restore).
SELECT current_setting('lock_timeout') AS before, set_config('lock_timeout', %(wait)s, true) AS bound;

-- name: lock_wait_restore
SELECT set_config('lock_timeout', %(before)s, true) AS restored;

-- name: table_lock_holders
-- The sessions whose locks a statement that gave up on a lock (lock_timeout) may have waited for, the oldest
-- transaction first (ops.lock_holders): on a table it writes (``writes``), any lock but a reader's ACCESS
-- SHARE (a row's lock is held by a session holding ROW SHARE or ROW EXCLUSIVE on its table; SHARE and up
-- lock the table); on one it only reads (``reads``), an ACCESS EXCLUSIVE one. Reads no table: not blocked.
SELECT a.pid, a.state, extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS seconds,
       left(regexp_replace(a.query, '[[:space:]]+', ' ', 'g'), 80) AS query
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid() AND a.pid IN (
    SELECT l.pid FROM pg_locks l
    WHERE l.granted AND l.locktype = 'relation'
      AND ((l.relation = ANY(ARRAY(SELECT to_regclass(t) FROM unnest(%(writes)s::text[]) t))
            AND l.mode <> 'AccessShareLock')
           OR (l.relation = ANY(ARRAY(SELECT to_regclass(t) FROM unnest(%(reads)s::text[]) t))
               AND l.mode = 'AccessExclusiveLock')))
ORDER BY a.xact_start NULLS LAST, a.pid
LIMIT 5;

-- name: claim_blockers
-- The sessions whose locks on job_queue hold claims back (a claim writes: ROW EXCLUSIVE waits behind SHARE
-- and stronger: a LOCK TABLE, a VACUUM FULL, a CREATE INDEX without CONCURRENTLY), the oldest transaction
-- first: what a --burst worker that gave up says (Worker._claim_blockers). Reads no table: not blocked itself.
SELECT a.pid, a.state, extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS seconds, l.mode,
       left(regexp_replace(a.query, '[[:space:]]+', ' ', 'g'), 80) AS query
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.locktype = 'relation' AND l.relation = to_regclass('job_queue')
  AND l.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
  AND a.pid <> pg_backend_pid()
ORDER BY a.xact_start NULLS LAST, a.pid
LIMIT 5;

-- name: burst_remaining
-- What keeps a --burst worker alive: running jobs, ready jobs, and retries it must still drain. Counted
-- as stats_live counts (migration 0011). Not jobs a pause or a limit of 0 holds: no worker may run them
-- (with a limit of 0 the burst waited for ever), as claim_solo leaves them: an expired lease held by a
-- pause or a limit of 0 stays running, but a kill or a poison pill ends in any queue.
SELECT (
    SELECT count(*) FROM job_queue j
    WHERE j.state = 'running'
      AND (%(all_queues)s OR j.queue = ANY(%(queues)s)) AND j.job_type = ANY(%(job_types)s)
      AND (j.cancel_requested OR (j.ran_solo AND j.attempts >= j.max_attempts)
           OR (j.queue <> ALL(ARRAY(SELECT name FROM queues WHERE paused))
               AND (j.locked_until >= %(now)s
                    OR NOT EXISTS (SELECT 1 FROM concurrency_limits l
                                   WHERE l.job_type = j.job_type AND l.max_running = 0
                                     AND l.queue IN ('*', j.queue)))))
) + (
    SELECT count(*) FROM job_queue j
    WHERE (j.state IN ('queued', 'retry_scheduled')) IS TRUE AND j.scheduled_at > '-infinity'
      AND (j.state = 'retry_scheduled' OR j.scheduled_at <= %(now)s)
      AND (%(all_queues)s OR j.queue = ANY(%(queues)s)) AND j.job_type = ANY(%(job_types)s)
      AND j.queue <> ALL(ARRAY(SELECT name FROM queues WHERE paused))
      AND NOT EXISTS (SELECT 1 FROM concurrency_limits l
                      WHERE l.job_type = j.job_type AND l.max_running = 0 AND l.queue IN ('*', j.queue))
) AS n;

-- name: next_due_at
SELECT min(scheduled_at) AS at FROM job_queue
WHERE state IN ('queued', 'retry_scheduled')
  AND (%(all_queues)s OR queue = ANY(%(queues)s)) AND job_type = ANY(%(job_types)s);

-- name: paused_queues
SELECT name FROM queues WHERE paused ORDER BY name;

------------------------------------------------------------------------------------------------------
-- Housekeeping (whoever wins the session's advisory lock does it, a batch per transaction)
------------------------------------------------------------------------------------------------------

-- name: try_housekeeping_lock
SELECT pg_try_advisory_lock(%(key)s) AS won;

-- name: housekeeping_unlock
SELECT pg_advisory_unlock(%(key)s);

-- name: prune_processed_keys
-- Expired idempotency records, oldest first, in batches. Not one whose key a job still holds that may run
-- again (waiting or running, or failed, dead-lettered or cancelled, which an operator may requeue): its
-- effect stays at most once for as long as such a job exists.
WITH doomed AS (
    SELECT p.idempotency_key FROM processed_keys p
    WHERE p.expires_at < %(now)s
      AND NOT EXISTS (
          SELECT 1 FROM job_queue j
          WHERE j.idempotency_key = p.idempotency_key AND j.state <> 'succeeded')
    ORDER BY p.expires_at
    LIMIT %(limit)s
    FOR UPDATE OF p SKIP LOCKED
)
DELETE FROM processed_keys p USING doomed d WHERE p.idempotency_key = d.idempotency_key;

-- name: prune_resource_locks
DELETE FROM resource_locks WHERE expires_at < %(now)s;

------------------------------------------------------------------------------------------------------
-- Reading (stats.py): the console, `qconsole stats` and the metrics endpoint share these. Each one
-- reads live states through the partial indexes, or the per-minute rollups: none scans finished rows.
------------------------------------------------------------------------------------------------------

-- name: stats_live
-- Waiting jobs through job_queue_waiting_idx (its predicate written as migration 0011 writes it), running
-- ones through job_queue_running_idx: no index holds every live state (see 0011). queued_later: the queued
-- jobs not due yet (of `queued`): "wait 20" counted 20 jobs scheduled a month ahead. running_expired: the
-- running jobs whose lease has run out (their worker died or froze): "run 8" looked healthy long after.
SELECT queue, job_type, sum(queued)::bigint AS queued, sum(queued_later)::bigint AS queued_later,
       sum(running)::bigint AS running, sum(running_expired)::bigint AS running_expired,
       sum(retry_scheduled)::bigint AS retry_scheduled, min(oldest_ready_at) AS oldest_ready_at
FROM (
    SELECT queue, job_type,
           count(*) FILTER (WHERE state = 'queued') AS queued,
           count(*) FILTER (WHERE state = 'queued' AND scheduled_at > %(now)s) AS queued_later, 0 AS running,
           0 AS running_expired,
           count(*) FILTER (WHERE state = 'retry_scheduled') AS retry_scheduled,
           min(scheduled_at) FILTER (WHERE scheduled_at <= %(now)s) AS oldest_ready_at
    FROM job_queue
    WHERE (state IN ('queued', 'retry_scheduled')) IS TRUE AND scheduled_at > '-infinity'
    GROUP BY queue, job_type
    UNION ALL
    SELECT queue, job_type, 0, 0, count(*), count(*) FILTER (WHERE locked_until < %(now)s), 0, NULL
    FROM job_queue
    WHERE state = 'running'
    GROUP BY queue, job_type
) live
GROUP BY queue, job_type;

-- name: stats_dead
SELECT queue, job_type,
       count(*) FILTER (WHERE state = 'failed') AS failed,
       count(*) FILTER (WHERE state = 'dead_lettered') AS dead_lettered
FROM job_queue
WHERE state IN ('failed', 'dead_lettered')
GROUP BY queue, job_type;

-- name: stats_window
-- The rollups, and the dedup hits not folded into them yet (fold_dedup_hits).
WITH rolled AS (
    SELECT queue, job_type,
           sum(started) AS started, sum(succeeded) AS succeeded, sum(failed) AS failed,
           sum(dead_lettered) AS dead_lettered, sum(retried) AS retried, sum(timeouts) AS timeouts,
           sum(anomalies) AS anomalies, sum(lock_contention) AS lock_contention, sum(dedup_hits) AS dedup_hits,
           sum(idempotency_hits) AS idempotency_hits, sum(lease_expirations) AS lease_expirations,
           sum(cancelled) AS cancelled, sum(enqueued) AS enqueued, sum(latency_ms_sum) AS latency_ms_sum,
           sum(duration_ms_sum) AS duration_ms_sum
    FROM job_metrics_minute
    WHERE minute >= %(since)s
    GROUP BY queue, job_type
), pending AS (
    SELECT queue, job_type, sum(hits) AS hits FROM dedup_hit_counts WHERE minute >= %(since)s GROUP BY 1, 2
)
SELECT coalesce(r.queue, p.queue) AS queue, coalesce(r.job_type, p.job_type) AS job_type,
       r.started, r.succeeded, r.failed, r.dead_lettered, r.retried, r.timeouts, r.anomalies, r.lock_contention,
       coalesce(r.dedup_hits, 0) + coalesce(p.hits, 0) AS dedup_hits,
       r.idempotency_hits, r.lease_expirations, r.cancelled, r.enqueued, r.latency_ms_sum, r.duration_ms_sum
FROM rolled r FULL JOIN pending p ON p.queue = r.queue AND p.job_type = r.job_type;

-- name: stats_series
SELECT minute, queue, job_type, succeeded, failed, dead_lettered, retried, lease_expirations, started
FROM job_metrics_minute
WHERE minute >= %(since)s
ORDER BY minute;

-- name: fragment_pause_reason
-- The reason the operator gave for the last pause or resume of the queues row `q`: its audit entry, written in the
-- same transaction at the same time (an index lookup on audit_log's time).
(SELECT a.reason FROM audit_log a
 WHERE a.at = q.changed_at AND a.queue = q.name AND a.action IN ('pause', 'resume')
 ORDER BY a.id DESC LIMIT 1)

-- name: queues_list
-- With the reason the operator gave for the last pause or resume (fragment_pause_reason).
SELECT q.name, q.paused, q.changed_at, q.changed_by, {{pause_reason}} AS reason
FROM queues q
ORDER BY q.name;

-- name: workers_list
-- The running ones first (live or lost), by host and pid; then those stopped in the last minutes, the
-- newest stop first: by host and pid, a live worker sat below ten stopped ones, out of sight at 80x24.
SELECT id, host, pid, queues, tasks, concurrency, in_flight, started_at, last_heartbeat_at, stopped_at,
       heartbeat_interval_seconds
FROM workers
WHERE stopped_at IS NULL OR stopped_at > %(since)s
ORDER BY stopped_at IS NOT NULL, stopped_at DESC, host, pid, id;

-- name: job_get
SELECT * FROM job_queue WHERE id = %(id)s;

-- name: job_lock
SELECT lock_key, token, job_id, expires_at FROM resource_locks WHERE job_id = %(id)s;

-- name: job_lock_key_holder
-- The job detail: who holds a job's lock_key now, whichever job that is (job_lock finds only a lease the job
-- holds itself: a job waiting on its key was told the key was free), with the holder's type and state.
-- Two primary-key lookups.
SELECT l.lock_key, l.token, l.job_id, l.expires_at, h.job_type AS holder_type, h.state AS holder_state
FROM resource_locks l
LEFT JOIN job_queue h ON h.id = l.job_id
WHERE l.lock_key = %(key)s;

-- name: job_lease_holder
-- The job detail: the worker a running job's locked_by names (a primary-key lookup), judged as workers_list's
-- rows are; and whether the job is a suspect, which only claim_solo takes (one at a time, to run alone).
SELECT j.suspect, j.ran_solo, w.id, w.host, w.pid, w.queues, w.tasks, w.concurrency, w.in_flight, w.started_at,
       w.last_heartbeat_at, w.stopped_at, w.heartbeat_interval_seconds
FROM job_queue j
LEFT JOIN workers w ON w.id = j.locked_by
WHERE j.id = %(id)s;

-- name: job_waiting
-- The job detail: why a waiting job has not started, or a running one's expired lease is not taken back
-- (stats.job_waiting), in one statement. Its queue's pause (who, when, why); the limits on its type that apply in
-- its queue, with the jobs they count: `running` as claim_limited counts them (for a waiting job), `running_live`
-- with a live lease as fragment_full_limits does (for an expired lease); the workers not stopped that registered its
-- type (stats.claims and stats.is_lost judge them); and, if `count_ahead`, the jobs before it in the claim order:
-- job_queue_ready_idx walked from its head to this job, at most `scan` entries (the index holds no queue: a job in a
-- small queue behind a million others would read them all), those of its queue due and not suspects counted (and of
-- them, those of its type).
SELECT q.paused, q.changed_by, q.changed_at, {{pause_reason}} AS pause_reason,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'job_type', l.job_type, 'queue', l.queue, 'max_running', l.max_running, 'source', l.source,
                   'reason', l.reason, 'updated_at', l.updated_at, 'set_by', {{limit_set_by}},
                   'running', r.running, 'running_live', r.running_live) ORDER BY l.queue), '[]')
        FROM concurrency_limits l
        CROSS JOIN LATERAL (
            SELECT count(*) AS running, count(*) FILTER (WHERE j.locked_until >= %(now)s) AS running_live
            FROM job_queue j
            WHERE j.state = 'running' AND j.job_type = l.job_type AND (l.queue = '*' OR j.queue = l.queue)) r
        WHERE l.job_type = %(job_type)s AND l.queue IN ('*', %(queue)s)) AS limits,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'id', w.id, 'host', w.host, 'pid', w.pid, 'queues', w.queues, 'tasks', w.tasks,
                   'concurrency', w.concurrency, 'in_flight', w.in_flight, 'started_at', w.started_at,
                   'last_heartbeat_at', w.last_heartbeat_at, 'stopped_at', w.stopped_at,
                   'heartbeat_interval_seconds', w.heartbeat_interval_seconds) ORDER BY w.id), '[]')
        FROM workers w
        WHERE w.stopped_at IS NULL AND %(job_type)s = ANY(w.tasks)) AS workers,
       ahead.ahead, ahead.ahead_of_type, ahead.scanned
FROM (SELECT 1) AS one
LEFT JOIN queues q ON q.name = %(queue)s
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE a.queue = %(queue)s AND a.scheduled_at <= %(now)s AND NOT a.suspect) AS ahead,
           count(*) FILTER (WHERE a.queue = %(queue)s AND a.scheduled_at <= %(now)s AND NOT a.suspect
                              AND a.job_type = %(job_type)s) AS ahead_of_type,
           count(*) AS scanned
    FROM (SELECT j.queue, j.job_type, j.scheduled_at, j.suspect FROM job_queue j
          WHERE j.state IN ('queued', 'retry_scheduled') AND %(count_ahead)s
            AND (j.priority, j.scheduled_at, j.id) < (%(priority)s, %(scheduled_at)s, %(id)s)
          ORDER BY j.priority, j.scheduled_at, j.id
          LIMIT %(scan)s) a
) AS ahead;

-- name: dead_letter_groups
-- The groups first, counted from job_queue_error_groups_idx (0013) in its order, the biggest `limit` of
-- them kept; then, for each of those only, its newest `max_ids` jobs and its newest error. Grouping every
-- failed row with its ids and messages in one aggregate sorted the whole table on disk at 100k dead letters.
-- A fingerprint is compared with "=" (or IS NULL in an arm of its own): IS NOT DISTINCT FROM takes no index.
WITH groups AS MATERIALIZED (
    SELECT job_type, error_fingerprint, state, count(*) AS n,
           min(coalesce(finished_at, updated_at)) AS first_seen,
           max(coalesce(finished_at, updated_at)) AS last_seen,
           -- over every group, before the LIMIT: what the screen says it shows the top of
           count(*) OVER () AS total_groups,
           sum(count(*)) FILTER (WHERE state <> 'retry_scheduled') OVER () AS total_dead,
           sum(count(*)) FILTER (WHERE state = 'retry_scheduled') OVER () AS total_retrying
    FROM job_queue
    WHERE state IN ('dead_lettered', 'failed', 'retry_scheduled') AND state = ANY(%(states)s)
      AND (%(job_type)s::text IS NULL OR job_type = %(job_type)s)
    GROUP BY job_type, error_fingerprint, state
    ORDER BY count(*) DESC, job_type, coalesce(error_fingerprint, '(no error recorded)')
    LIMIT %(limit)s
)
SELECT g.job_type, coalesce(g.error_fingerprint, '(no error recorded)') AS fingerprint, g.state, g.n,
       g.first_seen, g.last_seen, newest.sample_error, newest.job_ids, g.total_groups, g.total_dead,
       g.total_retrying
FROM groups g
CROSS JOIN LATERAL (
    SELECT (array_agg(p.last_error ORDER BY p.at DESC, p.id))[1] AS sample_error,
           array_agg(p.id ORDER BY p.at DESC, p.id) AS job_ids
    FROM (
        (SELECT j.id, j.last_error, coalesce(j.finished_at, j.updated_at) AS at FROM job_queue j
         WHERE j.job_type = g.job_type AND j.error_fingerprint = g.error_fingerprint AND j.state = g.state
           AND j.state IN ('dead_lettered', 'failed', 'retry_scheduled')
         ORDER BY coalesce(j.finished_at, j.updated_at) DESC, j.id LIMIT %(max_ids)s)
        UNION ALL
        (SELECT j.id, j.last_error, coalesce(j.finished_at, j.updated_at) AS at FROM job_queue j
         WHERE g.error_fingerprint IS NULL AND j.job_type = g.job_type AND j.error_fingerprint IS NULL
           AND j.state = g.state AND j.state IN ('dead_lettered', 'failed', 'retry_scheduled')
         ORDER BY coalesce(j.finished_at, j.updated_at) DESC, j.id LIMIT %(max_ids)s)
    ) AS p
) AS newest
ORDER BY g.n DESC, g.job_type, fingerprint;

-- name: audit_list
SELECT id, at, os_user, ssh_client, action, queue, job_ids, reason, detail
FROM audit_log ORDER BY at DESC, id DESC LIMIT %(limit)s;

------------------------------------------------------------------------------------------------------
-- Operator actions (ops.py). Each returns the ids it changed; the audit row is written in the same
-- transaction, so an action without its audit entry cannot commit.
------------------------------------------------------------------------------------------------------

-- name: is_read_only
SELECT current_setting('transaction_read_only') = 'on' AS ro;

-- name: requeue_jobs
-- Back to queued with a fresh budget. The history stays (attempts keep counting, so fencing stays
-- unique); a live job holding the same dedup key wins, and this one is skipped. Of several requeued at
-- once under one dedup key (dead runs of a periodic job), only the latest becomes live again.
-- A job killed while running gets back the dedup key the kill released (migration 0015).
WITH locked AS MATERIALIZED (
    SELECT id, payload, coalesce(dedup_key, released_dedup_key) AS dedup_key, created_at FROM job_queue
    WHERE id = ANY(%(ids)s) AND state IN ('dead_lettered', 'failed', 'cancelled')
      -- a fix made from the payload an operator read: not over one another made meanwhile
      AND (%(if_payload)s::jsonb IS NULL OR payload = %(if_payload)s::jsonb)
    ORDER BY id FOR UPDATE
), old AS (
    SELECT id, payload, dedup_key,
           dedup_key IS NULL OR row_number() OVER (PARTITION BY dedup_key ORDER BY created_at DESC, id) = 1
               AS first_of_key
    FROM locked
)
UPDATE job_queue j SET
    state = 'queued', max_attempts = j.attempts + %(budget)s, scheduled_at = %(now)s, finished_at = NULL,
    locked_until = NULL, cancel_requested = false, suspect = false, updated_at = %(now)s,
    payload = coalesce(%(payload)s::jsonb, j.payload), dedup_key = old.dedup_key, released_dedup_key = NULL
FROM old
WHERE j.id = old.id AND j.state IN ('dead_lettered', 'failed', 'cancelled') AND old.first_of_key
  AND (old.dedup_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM job_queue l
        WHERE l.dedup_key = old.dedup_key AND l.state IN ('queued', 'running', 'retry_scheduled')))
RETURNING j.id, j.queue, j.max_attempts - j.attempts AS budget, old.payload AS old_payload;

-- name: jobs_payload_changed
-- Of the jobs a requeue with if_payload skipped, those whose payload is no longer the one the fix was made from.
SELECT id FROM job_queue WHERE id = ANY(%(ids)s) AND payload <> %(payload)s::jsonb;

-- name: jobs_state_and_dedup
SELECT id, state, coalesce(dedup_key, released_dedup_key) AS dedup_key, cancel_requested FROM job_queue
WHERE id = ANY(%(ids)s);

-- name: kill_jobs
-- Waiting jobs are cancelled now; a running job is flagged, and its worker cancels it within a heartbeat.
-- One statement for both: a job moving between waiting and running while the operator kills it (a worker
-- giving it back at shutdown, or claiming it) is killed either way, because under READ COMMITTED a row
-- updated concurrently is re-checked, and the SET computed, on its newest version. (Two statements missed
-- a job released between them.) SET expressions read the old row; RETURNING reads the new one. The rows
-- are locked in id order first (see "Lock order" above heartbeat_jobs); a row changed meanwhile is
-- re-checked there the same way, before it is locked.
WITH target AS MATERIALIZED (
    SELECT id FROM job_queue
    WHERE id = ANY(%(ids)s)
      AND (state IN ('queued', 'retry_scheduled') OR (state = 'running' AND NOT cancel_requested))
    ORDER BY id FOR NO KEY UPDATE
)
UPDATE job_queue SET
    state = CASE WHEN state = 'running' THEN state ELSE 'cancelled' END,
    cancel_requested = (state = 'running'),
    finished_at = CASE WHEN state = 'running' THEN finished_at ELSE %(now)s END,
    errors = CASE WHEN state = 'running' THEN errors ELSE errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempts, 'kind', 'cancelled', 'class', 'Killed', 'message', %(message)s::text,
        'worker', NULL, 'at', %(now)s)) END,
    last_error = CASE WHEN state = 'running' THEN last_error ELSE 'Killed: ' || %(message)s::text END,
    -- a running one gives its dedup key up now (migration 0015): an equivalent message enqueued before its
    -- worker sees the kill is a new job, not one collapsed into the doomed one. A waiting one leaves the
    -- unique index's predicate as it is cancelled
    dedup_key = CASE WHEN state = 'running' THEN NULL ELSE dedup_key END,
    released_dedup_key = CASE WHEN state = 'running' THEN dedup_key ELSE released_dedup_key END,
    updated_at = %(now)s
WHERE id = ANY(ARRAY(SELECT id FROM target))
RETURNING id, state = 'cancelled' AS cancelled, queue, job_type;

-- name: discard_jobs
-- Dead letters an operator gives up on (dead_lettered | failed -> cancelled): off the dead-letter screen and
-- its counts, never run again (a requeue can still bring one back). Their last error and finished_at stay
-- (what they died of; retention counts from then); the discard is the newest entry of their history. Rows
-- locked in id order first (see "Lock order" above heartbeat_jobs).
WITH target AS MATERIALIZED (
    SELECT id FROM job_queue WHERE id = ANY(%(ids)s) AND state IN ('dead_lettered', 'failed')
    ORDER BY id FOR NO KEY UPDATE
)
UPDATE job_queue SET
    state = 'cancelled',
    errors = errors || jsonb_build_array(jsonb_build_object(
        'attempt', attempts, 'kind', 'cancelled', 'class', 'Discarded', 'message', %(message)s::text,
        'worker', NULL, 'at', %(now)s)),
    updated_at = %(now)s
WHERE id = ANY(ARRAY(SELECT id FROM target))
RETURNING id, queue, job_type;

-- name: group_ids
-- `fingerprint` NULL for the group of jobs with no error recorded (ops.group_job_ids): "=" or IS NULL, each
-- through job_queue_error_groups_idx, where coalesce(...) = ... read every row of the state.
SELECT id FROM job_queue
WHERE state = %(state)s AND job_type = %(job_type)s
  AND state IN ('dead_lettered', 'failed', 'retry_scheduled')
  AND (error_fingerprint = %(fingerprint)s OR (%(fingerprint)s::text IS NULL AND error_fingerprint IS NULL));

-- name: queue_set_paused
INSERT INTO queues (name, paused, changed_at, changed_by) VALUES (%(name)s, %(paused)s, %(now)s, %(actor)s)
ON CONFLICT (name) DO UPDATE SET paused = EXCLUDED.paused, changed_at = EXCLUDED.changed_at,
    changed_by = EXCLUDED.changed_by
RETURNING name, paused;

-- name: audit_insert
INSERT INTO audit_log (at, os_user, ssh_client, action, queue, job_ids, reason, detail)
VALUES (%(now)s, %(os_user)s, %(ssh_client)s, %(action)s, %(queue)s, %(job_ids)s, %(reason)s, %(detail)s::jsonb)
RETURNING id;

-- name: notify_queue
SELECT pg_notify('worker_core_jobs', %(queue)s);

-- name: notify_control
-- Paused queues or limits changed: every worker re-reads its claim filters (delivered on commit).
SELECT pg_notify('worker_core_control', %(what)s);

------------------------------------------------------------------------------------------------------
-- Console charts (stats.py): queue latency per minute from the rollups, and how many attempts the
-- jobs that finished in a window took (the partial index on finished jobs bounds the scan).
------------------------------------------------------------------------------------------------------

-- name: stats_latency_series
SELECT minute, queue, job_type, started, latency_ms_sum
FROM job_metrics_minute
WHERE minute >= %(since)s AND started > 0
ORDER BY minute;

-- name: stats_attempts_distribution
-- Of the newest `sample` jobs finished since `since` (through job_queue_finished_idx): all of a busy
-- hour's were a scan of the whole table (2 s at 6M rows finished within the hour).
SELECT job_type, attempts, count(*) AS n
FROM (SELECT job_type, attempts FROM job_queue
      WHERE state IN ('succeeded', 'failed', 'dead_lettered', 'cancelled') AND finished_at >= %(since)s
      ORDER BY finished_at DESC
      LIMIT %(sample)s) AS newest
GROUP BY job_type, attempts
ORDER BY job_type, attempts;

------------------------------------------------------------------------------------------------------
-- Retention and rollups (maintenance.py), done by whichever worker wins the housekeeping lock.
------------------------------------------------------------------------------------------------------

-- name: prune_finished
-- In batches, oldest first, so a large backlog never holds long locks; each batch from where the one before
-- stopped (after: its last finished_at), so the finished jobs of the other states before it (dead letters
-- kept 14 days, read past on the way to the succeeded ones) are read once a round, not once a batch.
WITH doomed AS (
    SELECT id FROM job_queue
    WHERE state = ANY(%(states)s) AND finished_at < %(before)s AND finished_at >= %(after)s
      AND created_at < %(counted_until)s
    ORDER BY finished_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM job_queue j USING doomed d WHERE j.id = d.id RETURNING j.finished_at;

-- name: prune_rollups
-- Per-minute counters past their retention, oldest first, through the primary key (minute first).
DELETE FROM job_metrics_minute WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM job_metrics_minute WHERE minute < %(before)s ORDER BY minute LIMIT %(limit)s
));

-- name: housekeeping_watermark
SELECT watermark FROM housekeeping WHERE name = %(name)s;

-- name: housekeeping_set_watermark
INSERT INTO housekeeping (name, watermark, updated_at) VALUES (%(name)s, %(watermark)s, %(now)s)
ON CONFLICT (name) DO UPDATE SET watermark = EXCLUDED.watermark, updated_at = EXCLUDED.updated_at;

-- name: oldest_created_at
SELECT min(created_at) AS at FROM job_queue;

-- name: rollup_enqueued
INSERT INTO job_metrics_minute AS m (minute, queue, job_type, enqueued)
SELECT date_trunc('minute', created_at), queue, job_type, count(*)
FROM job_queue
WHERE created_at >= %(since)s AND created_at < %(upto)s
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3
ON CONFLICT (minute, queue, job_type) DO UPDATE SET enqueued = m.enqueued + EXCLUDED.enqueued;

-- name: count_dedup_hits
-- In the producer's transaction: appended, never an upsert of a shared row (migration 0014).
INSERT INTO dedup_hit_counts (minute, queue, job_type, hits)
SELECT date_trunc('minute', coalesce(%(now)s::timestamptz, statement_timestamp())), r.queue, r.job_type, r.n
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(queue text, job_type text, n bigint);

-- name: fold_dedup_hits
-- Housekeeping: the committed hits move into the rollups in one statement (a reader sees them in one place
-- or the other, never both); hits of producers still in their transactions wait for the next round.
WITH moved AS (
    DELETE FROM dedup_hit_counts RETURNING minute, queue, job_type, hits
)
INSERT INTO job_metrics_minute AS m (minute, queue, job_type, dedup_hits)
SELECT minute, queue, job_type, sum(hits) FROM moved
GROUP BY 1, 2, 3
ORDER BY 1, 2, 3
ON CONFLICT (minute, queue, job_type) DO UPDATE SET dedup_hits = m.dedup_hits + EXCLUDED.dedup_hits;

------------------------------------------------------------------------------------------------------
-- Single-flight refills (coordination.py)
------------------------------------------------------------------------------------------------------

-- name: single_flight_get
SELECT value FROM single_flight_results WHERE key = %(key)s AND expires_at > coalesce(%(now)s::timestamptz, statement_timestamp());

-- name: single_flight_put
INSERT INTO single_flight_results (key, value, refilled_at, expires_at)
VALUES (%(key)s, %(value)s::jsonb, coalesce(%(now)s::timestamptz, statement_timestamp()), coalesce(%(now)s::timestamptz, statement_timestamp()) + make_interval(secs => %(ttl)s))
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, refilled_at = EXCLUDED.refilled_at,
    expires_at = EXCLUDED.expires_at;

-- name: single_flight_forget
DELETE FROM single_flight_results WHERE key = %(key)s;

-- name: prune_single_flight
DELETE FROM single_flight_results WHERE expires_at < %(now)s;

-- name: job_queue_stats_age
-- Whether the planner's statistics of job_queue are missing or stale (a burst from an empty table):
-- with none, it sorts every ready job on each claim instead of walking the ready index.
SELECT (s.last_analyze IS NULL AND s.last_autoanalyze IS NULL) AS never, s.n_mod_since_analyze AS modified,
       greatest(c.reltuples, 1)::bigint AS analyzed_rows
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid WHERE s.relid = 'job_queue'::regclass;

-- name: analyze_job_queue
ANALYZE job_queue;

------------------------------------------------------------------------------------------------------
-- Job type contracts (policy registry as the fleet runs it)
------------------------------------------------------------------------------------------------------

-- name: contract_upsert
INSERT INTO job_type_contracts (job_type, queue, contract, reason, requires_idempotency_key, concurrency,
                                reported_by, reported_at)
SELECT job_type, queue, contract, reason, requires_idempotency_key, concurrency, %(worker)s, %(now)s
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(job_type text, queue text, contract jsonb, reason text,
                                                requires_idempotency_key boolean, concurrency int)
ON CONFLICT (job_type) DO UPDATE SET queue = EXCLUDED.queue, contract = EXCLUDED.contract,
    reason = EXCLUDED.reason, requires_idempotency_key = EXCLUDED.requires_idempotency_key,
    concurrency = EXCLUDED.concurrency, reported_by = EXCLUDED.reported_by, reported_at = EXCLUDED.reported_at;

-- name: contracts_list
SELECT job_type, queue, contract, reason, requires_idempotency_key, concurrency, reported_by, reported_at
FROM job_type_contracts ORDER BY job_type;

-- name: contracts_for_types
SELECT job_type, queue, contract, requires_idempotency_key FROM job_type_contracts WHERE job_type = ANY(%(job_types)s);

-- name: deployment_policy_upsert
-- A worker's policy (migration 0016), in the transaction of its contracts; returns the one it replaced.
WITH before AS (SELECT defaults, queues, source, reported_by, reported_at FROM deployment_policy)
INSERT INTO deployment_policy AS p (singleton, defaults, queues, source, reported_by, reported_at)
VALUES (true, %(defaults)s::jsonb, %(queues)s::jsonb, %(source)s, %(worker)s, %(now)s)
ON CONFLICT (singleton) DO UPDATE SET defaults = EXCLUDED.defaults, queues = EXCLUDED.queues,
    source = EXCLUDED.source, reported_by = EXCLUDED.reported_by, reported_at = EXCLUDED.reported_at
RETURNING (SELECT to_jsonb(before) FROM before) AS replaced;

-- name: deployment_policy_get
SELECT defaults, queues, source, reported_by, reported_at FROM deployment_policy;

------------------------------------------------------------------------------------------------------
-- A console action's token (worker_core.ops: hold_action_token, action_session_ended, audit_entry_of_token)
-- and whether a session may work (worker_refusal)
------------------------------------------------------------------------------------------------------

-- name: action_token_hold
-- Held by the action's session until it ends, whatever becomes of its client (the two-key form: no other lock
-- of the queue's uses it).
SELECT pg_advisory_lock(%(class)s, %(key)s);

-- name: action_token_free
SELECT pg_try_advisory_lock(%(class)s, %(key)s) AS ended;

-- name: audit_by_token
SELECT id, cardinality(job_ids) AS changed
FROM (SELECT id, job_ids, detail FROM audit_log ORDER BY id DESC LIMIT %(rows)s) newest
WHERE detail ->> %(key)s = %(token)s;

-- name: table_privilege
SELECT has_table_privilege(%(table)s, %(privilege)s) AS ok;
