"""The envelope contract at enqueue: every bad envelope is refused with a clear EnvelopeError and writes
nothing; valid ones are stored as given; enqueue is transactional with the caller's writes."""

from __future__ import annotations

import datetime as dt
import json
import math
import threading
import uuid
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.worker_core.tasks  # registers the t.* types (their per-type defaults)
from worker_core import EnvelopeError, FixedClock, RetryPolicy, db, enqueue, enqueue_many
from worker_core.envelope import MAX_PAYLOAD_BYTES, VISIBILITY_BUFFER_SECONDS

T0 = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def count(conn: db.Conn) -> int:
    row = conn.execute("SELECT count(*) AS n FROM job_queue").fetchone()
    assert row is not None
    return int(row["n"])


def nested(depth: int) -> dict[str, Any]:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return {"deep": value}


def exactly(size: int) -> dict[str, Any]:
    """A payload whose compact JSON is exactly ``size`` bytes."""
    return {"b": "x" * (size - len('{"b":""}'))}


# (job_type, payload, envelope fields, what the message must say)
BAD: list[tuple[str, Any, Any, dict[str, Any], str]] = [
    ("unknown-field", "t.ok", {}, {"colour": "red"}, "unknown envelope field 'colour'"),
    ("unknown-field-delay-typo", "t.ok", {}, {"delay": 5}, "unknown envelope field 'delay'"),
    ("system-attempt", "t.ok", {}, {"attempt": 3}, "attempt is managed by the system"),
    ("system-job_id", "t.ok", {}, {"job_id": uuid.uuid4()}, "job_id is managed by the system"),
    ("system-state", "t.ok", {}, {"state": "succeeded"}, "state is managed by the system"),
    ("job_type-empty", "", {}, {}, "job_type is required"),
    ("job_type-none", None, {}, {}, "job_type is required"),
    ("job_type-upper", "Invoice.Generate", {}, {}, "must match [a-z0-9_.-]+"),
    ("job_type-space", "invoice generate", {}, {}, "must match"),
    ("job_type-newline", "t.ok\n", {}, {}, "must match"),
    ("job_type-unicode", "factură", {}, {}, "must match"),
    ("job_type-too-long", "a" * 201, {}, {}, "must match"),
    ("payload-list", "t.ok", [1, 2], {}, "payload must be a JSON object, not list"),
    ("payload-str", "t.ok", '{"a": 1}', {}, "payload must be a JSON object, not str"),
    ("payload-int", "t.ok", 7, {}, "payload must be a JSON object, not int"),
    ("payload-datetime", "t.ok", {"at": T0}, {}, "payload is not JSON-serialisable"),
    ("payload-set", "t.ok", {"ids": {1, 2}}, {}, "payload is not JSON-serialisable"),
    ("payload-nan", "t.ok", {"x": math.nan}, {}, "payload is not JSON-serialisable"),
    ("payload-inf", "t.ok", {"x": [math.inf]}, {}, "payload is not JSON-serialisable"),
    ("payload-too-deep", "t.ok", nested(5000), {}, "payload is not JSON-serialisable"),
    ("payload-deep", "t.ok", nested(150), {}, "levels deep, over the limit of 100"),
    # jsonb keeps numbers as numeric, which has no exponent: 7 bytes of "1e+308" come back as 309 digits
    ("payload-stored-size", "t.ok", {"n": [1e308] * 900}, {}, f"as stored, over the limit of {MAX_PAYLOAD_BYTES}"),
    ("payload-int-key", "t.ok", {1: "a", "1": "b"}, {}, "payload keys must be strings"),
    ("payload-nested-key", "t.ok", {"a": [{None: 1}]}, {}, "payload keys must be strings"),
    ("payload-nul", "t.ok", {"x": "a\x00b"}, {}, "payload must not contain NUL"),
    ("payload-surrogate", "t.ok", {"x": "\ud800"}, {}, "lone surrogate"),
    ("payload-over-limit", "t.ok", exactly(MAX_PAYLOAD_BYTES + 1), {}, f"over the limit of {MAX_PAYLOAD_BYTES}"),
    ("max_attempts-0", "t.ok", {}, {"max_attempts": 0}, "max_attempts must be an integer between 1"),
    ("max_attempts-negative", "t.ok", {}, {"max_attempts": -3}, "max_attempts must be"),
    ("max_attempts-float", "t.ok", {}, {"max_attempts": 2.5}, "max_attempts must be"),
    ("max_attempts-bool", "t.ok", {}, {"max_attempts": True}, "max_attempts must be"),
    ("max_attempts-huge", "t.ok", {}, {"max_attempts": 2**40}, "max_attempts must be"),
    ("visibility-equal", "t.ok", {}, {"timeout_seconds": 10, "visibility_timeout_seconds": 10}, "must exceed"),
    ("visibility-at-buffer", "t.ok", {}, {"timeout_seconds": 10, "visibility_timeout_seconds": 15}, "plus a buffer"),
    ("visibility-below", "t.ok", {}, {"timeout_seconds": 60, "visibility_timeout_seconds": 30}, "must exceed"),
    ("visibility-nan", "t.ok", {}, {"visibility_timeout_seconds": math.nan}, "finite number"),
    ("visibility-negative", "t.ok", {}, {"visibility_timeout_seconds": -5}, "visibility_timeout_seconds must be > 0"),
    ("visibility-huge", "t.ok", {}, {"visibility_timeout_seconds": 1e13}, "visibility_timeout_seconds must be at"),
    ("timeout-zero", "t.ok", {}, {"timeout_seconds": 0}, "timeout_seconds must be > 0"),
    ("timeout-negative", "t.ok", {}, {"timeout_seconds": -1}, "timeout_seconds must be > 0"),
    ("timeout-str", "t.ok", {}, {"timeout_seconds": "30"}, "timeout_seconds must be a finite number"),
    ("timeout-huge", "t.ok", {}, {"timeout_seconds": 1e13}, "at most"),
    ("delay-negative", "t.ok", {}, {"delay_seconds": -1}, "delay_seconds must not be negative"),
    ("delay-inf", "t.ok", {}, {"delay_seconds": math.inf}, "delay_seconds must be a finite number"),
    ("delay-huge", "t.ok", {}, {"delay_seconds": 1e300}, "delay_seconds must be at most"),
    ("delay-and-scheduled", "t.ok", {}, {"delay_seconds": 5, "scheduled_at": T0}, "not both"),
    ("scheduled-naive", "t.ok", {}, {"scheduled_at": dt.datetime(2030, 1, 1)}, "timezone-aware"),
    # stored as 1 BC and as year 10000: the claim committed, then could not read its own batch
    ("scheduled-year-1", "t.ok", {}, {"scheduled_at": dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5)))},
     "scheduled_at must be between 1970-01-01 and 3000-01-01"),
    ("scheduled-year-9999", "t.ok", {},
     {"scheduled_at": dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(dt.timedelta(hours=-5)))},
     "scheduled_at must be between"),
    ("idem-iso-timestamp", "t.ok", {}, {"idempotency_key": "invoice:inv_1:2024-05-01T10:00:00"}, "timestamp"),
    ("idem-space-timestamp", "t.ok", {}, {"idempotency_key": "charge 2024-05-01 10:00"}, "timestamp"),
    ("idem-empty", "t.ok", {}, {"idempotency_key": "  "}, "idempotency_key must be a non-empty string"),
    ("idem-int", "t.ok", {}, {"idempotency_key": 42}, "idempotency_key must be a non-empty string"),
    ("idem-nul", "t.ok", {}, {"idempotency_key": "a\x00b"}, "idempotency_key must be valid text"),
    ("idem-too-long", "t.ok", {}, {"idempotency_key": "k" * 513}, "longer than 512"),
    ("idem-required", "t.ledger", {}, {}, "an idempotency_key is required"),
    ("dedup-surrogate", "t.ok", {}, {"dedup_key": "d\udc80"}, "dedup_key must be valid text"),
    ("lock-empty", "t.ok", {}, {"lock_key": ""}, "lock_key must be a non-empty string"),
    ("tenant-nul", "t.ok", {}, {"tenant_id": "\x00"}, "tenant_id must be valid text"),
    ("queue-space", "t.ok", {}, {"queue": "my queue"}, "queue 'my queue' must match"),
    ("queue-empty", "t.ok", {}, {"queue": ""}, "must match"),
    ("queue-newline", "t.ok", {}, {"queue": "q\n"}, "must match"),
    ("priority-str", "t.ok", {}, {"priority": "high"}, "priority must be an integer"),
    ("priority-huge", "t.ok", {}, {"priority": 10**30}, "priority must be an integer between -1000 and 1000"),
    ("retry-backoff", "t.ok", {}, {"retry_policy": {"backoff": "random"}}, "backoff must be one of"),
    ("retry-unknown", "t.ok", {}, {"retry_policy": {"tries": 3}}, "unknown retry policy fields: tries"),
    ("retry-inf", "t.ok", {}, {"retry_policy": {"max_delay_seconds": math.inf}}, "max_delay_seconds must be"),
    ("retry-jitter", "t.ok", {}, {"retry_policy": {"jitter": 2}}, "jitter must be between 0 and 1"),
    ("retry-huge-int", "t.ok", {}, {"retry_policy": {"base_seconds": 10**400}}, "base_seconds must be a finite"),
    ("timeout-huge-int", "t.ok", {}, {"timeout_seconds": 10**400}, "must be a finite number, not a huge integer"),
]


@pytest.mark.parametrize(("job_type", "payload", "fields", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_envelope_is_refused_with_a_clear_message_and_writes_nothing(
    tx_conn: db.Conn, job_type: Any, payload: Any, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(EnvelopeError) as err:
        enqueue(tx_conn, job_type, payload, **fields)
    assert str(err.value).startswith("invalid job envelope: ")
    assert message in str(err.value), str(err.value)
    assert len(err.value.problems) == 1, err.value.problems  # one mistake, one message
    assert isinstance(err.value, ValueError)
    assert count(tx_conn) == 0


def test_every_problem_is_reported_at_once(tx_conn: db.Conn) -> None:
    with pytest.raises(EnvelopeError) as err:
        enqueue(tx_conn, "Bad Type", [1], max_attempts=0, delay_seconds=-1, colour="red", attempt=2)
    text = str(err.value)
    for fragment in (
        "unknown envelope field 'colour'",
        "attempt is managed",
        "job_type 'Bad Type'",
        "payload must be a JSON object",
        "max_attempts",
        "delay_seconds must not be negative",
    ):
        assert fragment in text
    assert len(err.value.problems) == 6
    assert count(tx_conn) == 0


# (envelope fields, what each problem must say): one problem hid another
HIDDEN: list[tuple[str, dict[str, Any], list[str]]] = [
    ("bad-timeout-negative-lease", {"timeout_seconds": 0, "visibility_timeout_seconds": -5},
     ["timeout_seconds must be > 0", "visibility_timeout_seconds must be > 0"]),
    ("bad-time-and-delay", {"scheduled_at": dt.datetime(2030, 1, 1), "delay_seconds": 5},
     ["timezone-aware", "not both"]),
    ("unknown-and-bad-retry-fields", {"retry_policy": {"tries": 3, "jitter": 2}},
     ["unknown retry policy fields: tries", "jitter must be between 0 and 1"]),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "messages"), [h[1:] for h in HIDDEN], ids=[h[0] for h in HIDDEN])
def test_no_problem_of_an_envelope_hides_another(tx_conn: db.Conn, fields: dict[str, Any], messages: list[str]) -> None:
    with pytest.raises(EnvelopeError) as err:
        enqueue(tx_conn, "t.ok", {}, **fields)
    assert len(err.value.problems) == len(messages), err.value.problems
    for message, problem in zip(messages, err.value.problems, strict=True):
        assert message in problem, err.value.problems
    assert count(tx_conn) == 0


GOOD: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("minimal", "t.ok", {}, {}),
    ("unregistered-type", "report.render-v2", {"n": 1}, {}),
    ("payload-at-limit", "t.ok", exactly(MAX_PAYLOAD_BYTES), {}),
    ("payload-escaped-backslash-u0000", "t.ok", {"doc": "write NUL as \\u0000 in JSON"}, {}),
    ("payload-unicode", "t.ok", {"name": "Zoë ✓ 日本", "n": [1, 2.5, None, True, {"k": "v"}]}, {}),
    ("visibility-just-above", "t.ok", {}, {"timeout_seconds": 10, "visibility_timeout_seconds": 15.001}),
    ("priority-bounds", "t.ok", {}, {"priority": -1000}),
    ("max_attempts-1", "t.ok", {}, {"max_attempts": 1}),
    ("delay-zero", "t.ok", {}, {"delay_seconds": 0}),
    ("scheduled-other-tz", "t.ok", {}, {"scheduled_at": dt.datetime(2030, 1, 2, 12, tzinfo=dt.timezone(dt.timedelta(hours=5)))}),  # noqa: E501
    ("scheduled-in-the-past", "t.ok", {}, {"scheduled_at": dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)}),
    ("idem-with-date-only", "t.ledger", {}, {"idempotency_key": "invoice:2024-05:cust_1"}),
    ("retry-object", "t.ok", {}, {"retry_policy": RetryPolicy("linear", 3, 30, 0)}),
    (
        "everything",
        "t.ledger",
        {"item": "inv_1", "amount": 12.5},
        {
            "queue": "billing.eu",
            "idempotency_key": "invoice:inv_1",
            "dedup_key": "invoice:inv_1:v1",
            "lock_key": "order:ord_987",
            "priority": 5,
            "delay_seconds": 30,
            "max_attempts": 7,
            "timeout_seconds": 12.5,
            "visibility_timeout_seconds": 40,
            "retry_policy": {"backoff": "fixed", "base_seconds": 3},
            "tenant_id": "acme",
            "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        },
    ),
]


@pytest.mark.parametrize(("job_type", "payload", "fields"), [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_valid_envelope_is_stored_as_given(
    tx_conn: db.Conn, job_type: str, payload: dict[str, Any], fields: dict[str, Any]
) -> None:
    result = enqueue(tx_conn, job_type, payload, clock=FixedClock(T0), **fields)
    assert result.created and result.duplicate_of is None
    row = tx_conn.execute("SELECT * FROM job_queue WHERE id = %s", (result.id,)).fetchone()
    assert row is not None
    assert row["state"] == "queued" and row["attempts"] == 0 and row["errors"] == []
    assert row["job_type"] == job_type
    assert row["payload"] == payload
    for name in ("queue", "idempotency_key", "dedup_key", "lock_key", "priority", "max_attempts",
                 "timeout_seconds", "visibility_timeout_seconds", "tenant_id", "trace_id"):  # fmt: skip
        if name in fields:
            assert row[name] == fields[name], name
    assert row["visibility_timeout_seconds"] > row["timeout_seconds"] + VISIBILITY_BUFFER_SECONDS
    expected_at = fields.get("scheduled_at") or T0 + dt.timedelta(seconds=fields.get("delay_seconds", 0))
    assert row["scheduled_at"] == max(expected_at, T0)  # a time already past: due now
    policy = fields.get("retry_policy")
    if isinstance(policy, RetryPolicy):
        assert row["retry_policy"] == policy.to_json()
    elif policy:
        assert {k: row["retry_policy"][k] for k in policy} == policy


def test_type_defaults_come_from_the_registry(tx_conn: db.Conn) -> None:
    res = enqueue(tx_conn, "t.stubborn", {})
    row = tx_conn.execute("SELECT * FROM job_queue WHERE id = %s", (res.id,)).fetchone()
    assert row is not None
    assert (row["timeout_seconds"], row["visibility_timeout_seconds"], row["max_attempts"]) == (1, 10, 1)
    assert row["retry_policy"] == tests.worker_core.tasks.FAST.to_json()


# --------------------------------------------------------------------------- enqueue_many


def test_enqueue_many_validates_every_envelope_before_writing_anything(tx_conn: db.Conn) -> None:
    batch = [
        ("t.ok", {"n": 0}),
        ("t.ok", [1], {}),
        ("t.ok", {"n": 2}),
        ("t.ok", {"n": 3}, {"max_attempts": 0}),
    ]
    with pytest.raises(EnvelopeError) as err:
        enqueue_many(tx_conn, batch)
    assert [p.split(":")[0] for p in err.value.problems] == ["job 1", "job 3"]
    assert "payload must be a JSON object" in err.value.problems[0]
    assert "max_attempts" in err.value.problems[1]
    assert count(tx_conn) == 0


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        (("t.ok",), "a tuple of 1"),
        (("t.ok", {}, {}, {}), "a tuple of 4"),
        ("t.ok", "not str"),
        (None, "not NoneType"),
        ((["t.ok"], {}), "job_type must be a string, not list"),
        ((7, {}), "job_type must be a string, not int"),
        (("t.ok", {}, None), "envelope fields must be a mapping, not NoneType"),
        (("t.ok", {}, [("queue", "q")]), "envelope fields must be a mapping, not list"),
    ],
    ids=["no-payload", "four-items", "a-string", "none", "unhashable-type", "int-type", "fields-none", "fields-list"],
)
def test_enqueue_many_refuses_a_malformed_item_with_the_others_problems(
    tx_conn: db.Conn, item: Any, problem: str
) -> None:
    # an IndexError, a TypeError (unhashable type) or an AttributeError ('NoneType' has no 'get'), not the
    # EnvelopeError that lists what is wrong with which job
    batch = [("t.ok", {"n": 0}), item, ("t.ok", {"n": 2}, {"max_attempts": 0}), ["t.ok", {"n": 3}]]
    with pytest.raises(EnvelopeError) as err:
        enqueue_many(tx_conn, batch)
    assert [p.split(":")[0] for p in err.value.problems] == ["job 1", "job 2"]
    assert problem in err.value.problems[0] and "max_attempts" in err.value.problems[1]
    assert count(tx_conn) == 0


def test_enqueue_many_inserts_in_order_and_collapses_dedup_keys(tx_conn: db.Conn) -> None:
    held = enqueue(tx_conn, "t.ok", {"n": "held"}, dedup_key="held")
    results = enqueue_many(
        tx_conn,
        [
            ("t.ok", {"n": 0}),
            ("t.ok", {"n": 1}, {"dedup_key": "a"}),
            ("t.ok", {"n": 2}),
            ("t.ok", {"n": 3}, {"dedup_key": "a"}),
            ("t.ok", {"n": 4}, {"dedup_key": "held"}),
            ("t.ok", {"n": 5}, {"queue": "other"}),
        ],
    )
    assert [r.created for r in results] == [True, True, True, False, False, True]
    assert results[3].duplicate_of == results[1].id
    assert results[4].duplicate_of == held.id
    payloads = {r["id"]: r["payload"]["n"] for r in tx_conn.execute("SELECT id, payload FROM job_queue")}
    assert [payloads[r.id] for r in results] == [0, 1, 2, 1, "held", 5]
    assert count(tx_conn) == 5  # held + 4 new
    assert enqueue_many(tx_conn, []) == []


# --------------------------------------------------------------------------- transactional enqueue


@pytest.mark.parametrize("enqueue_first", [False, True], ids=["write-then-enqueue", "enqueue-then-write"])
def test_enqueue_is_transactional_with_the_business_write(dsn: str, enqueue_first: bool) -> None:
    with db.connect(dsn) as conn:  # not autocommit: the caller's transaction
        if enqueue_first:  # the enqueue is what opens the caller's transaction: it must not commit it
            rolled_back = enqueue(conn, "t.ok", {"order": 1})
        conn.execute("INSERT INTO ledger (job_id, item) VALUES (%s, 'order-1')", (uuid.uuid4(),))
        if not enqueue_first:
            rolled_back = enqueue(conn, "t.ok", {"order": 1})
        conn.rollback()
        assert count(conn) == 0
        assert conn.execute("SELECT count(*) AS n FROM ledger").fetchone() == {"n": 0}
        rolled_back_many = enqueue_many(conn, [("t.ok", {"order": "1b"})])
        conn.rollback()
        assert count(conn) == 0

        conn.execute("INSERT INTO ledger (job_id, item) VALUES (%s, 'order-2')", (uuid.uuid4(),))
        committed = enqueue(conn, "t.ok", {"order": 2})
        conn.commit()

        with pytest.raises(RuntimeError), conn.transaction():
            enqueue(conn, "t.ok", {"order": 3})
            raise RuntimeError("the business write failed")

    with db.connect(dsn, autocommit=True) as other:
        ids = [r["id"] for r in other.execute("SELECT id FROM job_queue")]
        assert ids == [committed.id]
        assert rolled_back.id not in ids and rolled_back_many[0].id not in ids
        assert other.execute("SELECT item FROM ledger").fetchall() == [{"item": "order-2"}]


def test_workers_are_notified_only_when_the_enqueue_commits(dsn: str) -> None:
    with db.connect(dsn, autocommit=True) as listener, db.connect(dsn) as producer:
        listener.execute("LISTEN worker_core_jobs")
        enqueue(producer, "t.ok", {}, queue="rolled-back")
        producer.rollback()
        enqueue(producer, "t.ok", {}, queue="committed")
        producer.commit()
        # notifications arrive in commit order: had the rolled-back one been sent, it would come first
        got = [n.payload for n in listener.notifies(timeout=10, stop_after=1)]
        assert got == ["committed"]


def test_dedup_key_collapses_live_duplicates_at_enqueue(tx_conn: db.Conn) -> None:
    first = enqueue(tx_conn, "t.ok", {"v": 1}, dedup_key="report:42")
    second = enqueue(tx_conn, "t.ok", {"v": 2}, dedup_key="report:42")
    assert first.created and not second.created
    assert second.duplicate_of == first.id
    assert count(tx_conn) == 1
    other = enqueue(tx_conn, "t.ok", {"v": 3}, dedup_key="report:43")
    assert other.created


def test_a_scheduled_at_in_the_past_is_stored_as_the_enqueue_time(tx_conn: db.Conn) -> None:
    # it was stored as given: a job backdated to 2000 read as 26 years of queue latency and lag (counted from
    # scheduled_at), and went ahead of every job of its priority enqueued before it
    past, future = T0 - dt.timedelta(days=365 * 30), T0 + dt.timedelta(hours=1)
    clock = FixedClock(T0)
    one = enqueue(tx_conn, "t.ok", {}, scheduled_at=past, dedup_key="d", clock=clock)
    many = enqueue_many(tx_conn, [("t.ok", {}, {"scheduled_at": at}) for at in (past, future)], clock=clock)
    held = enqueue(tx_conn, "t.ok", {}, scheduled_at=past, dedup_key="d", clock=FixedClock(future))  # a dedup hit
    assert held.duplicate_of == one.id
    stored = {r["id"]: r["scheduled_at"] for r in tx_conn.execute("SELECT id, scheduled_at FROM job_queue")}
    assert stored == {one.id: T0, many[0].id: T0, many[1].id: future}


# --------------------------------------------------------------------------- property


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality, with numbers compared as numbers (jsonb keeps them as decimals)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


weird_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["", " ", "a\x00", "\ud800", "x\n", "2024-05-01T10:00", "ok", "k" * 600]
)
json_leaf = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | weird_text
)
json_value = st.recursive(
    json_leaf,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(weird_text, children, max_size=3)
    | st.dictionaries(st.integers(0, 3) | st.none(), children, max_size=2),
    max_leaves=12,
)
payloads = st.dictionaries(weird_text, json_value, max_size=4) | json_value
job_types = st.sampled_from(["t.ok", "t.ledger", "t.stubborn", "a.b-c_1", "", "Upper", "t.ok\n"]) | st.text(max_size=8)
numbers = st.integers(-5, 10**12) | st.floats(allow_nan=True, allow_infinity=True) | st.none() | st.just("5")
keys = weird_text | st.none() | st.integers()
envelope_fields = st.fixed_dictionaries(
    {},
    optional={
        "queue": st.sampled_from(["default", "billing.eu", "bad queue", ""]) | weird_text,
        "idempotency_key": keys,
        "dedup_key": keys,
        "lock_key": keys,
        "priority": st.integers(-2000, 2000) | st.sampled_from([True, 1.5, None]),
        "scheduled_at": st.datetimes(timezones=st.just(dt.timezone.utc)) | st.datetimes() | st.just("tomorrow"),
        "delay_seconds": numbers,
        "max_attempts": numbers,
        "timeout_seconds": numbers,
        "visibility_timeout_seconds": numbers,
        "retry_policy": st.none()
        | st.fixed_dictionaries(
            {},
            optional={
                "backoff": weird_text | st.sampled_from(["fixed", "exponential"]),
                "base_seconds": numbers,
                "max_delay_seconds": numbers,
                "jitter": numbers,
                "extra": st.just(1),
            },
        )
        | st.just("fast"),
        "tenant_id": keys,
        "trace_id": keys,
        "attempt": st.integers(0, 3),
        "colour": st.just("red"),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job_type=job_types, payload=payloads, fields=envelope_fields)
def test_any_envelope_is_either_stored_as_given_or_refused_with_envelope_error(
    tx_conn: db.Conn, job_type: Any, payload: Any, fields: dict[str, Any]
) -> None:
    with tx_conn.transaction(force_rollback=True):  # a savepoint per example
        try:
            result = enqueue(tx_conn, job_type, payload, clock=FixedClock(T0), **fields)
        except EnvelopeError as e:
            assert e.problems and all(isinstance(p, str) and p for p in e.problems)
            assert count(tx_conn) == 0
            return
        row = tx_conn.execute("SELECT * FROM job_queue WHERE id = %s", (result.id,)).fetchone()
        assert row is not None and count(tx_conn) == 1
        assert row["job_type"] == job_type and row["state"] == "queued" and row["attempts"] == 0
        expected = {} if payload is None else json.loads(json.dumps(payload))  # None means "no payload"
        assert _same_json(expected, row["payload"]), (payload, row["payload"])
        for name in ("queue", "idempotency_key", "dedup_key", "lock_key", "priority", "max_attempts",
                     "tenant_id", "trace_id"):  # fmt: skip
            if fields.get(name) is not None:
                assert row[name] == fields[name], name
        for name in ("timeout_seconds", "visibility_timeout_seconds"):
            if fields.get(name) is not None:
                assert row[name] == float(fields[name]), name
        if fields.get("scheduled_at") is not None:
            assert row["scheduled_at"] == max(fields["scheduled_at"], T0)
        else:
            delay = dt.timedelta(seconds=fields.get("delay_seconds") or 0)
            assert abs(row["scheduled_at"] - (T0 + delay)) <= dt.timedelta(milliseconds=1)
        assert row["visibility_timeout_seconds"] > row["timeout_seconds"] + VISIBILITY_BUFFER_SECONDS


def test_a_timeout_given_alone_brings_a_lease_long_enough_for_it(tx_conn: db.Conn) -> None:
    # the type's lease (derived from its own timeout) would refuse a longer timeout: it grows with it
    r = enqueue(tx_conn, "unregistered.type", {}, timeout_seconds=120)
    row = tx_conn.execute("SELECT timeout_seconds, visibility_timeout_seconds FROM job_queue WHERE id = %s",
                          (r.id,)).fetchone()  # fmt: skip
    assert row == {"timeout_seconds": 120, "visibility_timeout_seconds": 150}
    # never below the type's own lease (t.stubborn: 10 s for its 1 s timeout)
    r = enqueue(tx_conn, "t.stubborn", {}, timeout_seconds=2)
    row = tx_conn.execute("SELECT visibility_timeout_seconds FROM job_queue WHERE id = %s", (r.id,)).fetchone()
    assert row == {"visibility_timeout_seconds": 32}
    with pytest.raises(EnvelopeError, match="must exceed"):  # both given: as given, checked
        enqueue(tx_conn, "unregistered.type", {}, timeout_seconds=120, visibility_timeout_seconds=90)


def test_enqueue_many_when_a_dedup_holder_finishes_between_its_insert_and_its_look_up(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the live holder of "k" makes the insert skip it; it finishes before the look-up finds it: the job is
    # inserted again (it raised KeyError, after the rows without a key were written)
    from worker_core import producer

    holder = enqueue(conn, "t.ok", {}, dedup_key="k").id
    conn.commit()
    finished: list[bool] = []
    real = producer.dict_cursor

    class HolderFinishesMeanwhile:
        def __init__(self, cur: Any) -> None:
            self.cur = cur

        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            if "dedup_key = ANY" in str(query) and not finished:
                with db.connect(dsn, autocommit=True) as other:
                    done = "UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE id = %s"
                    other.execute(done, (holder,))
                finished.append(True)
            return self.cur.execute(query, *args, **kwargs)

    monkeypatch.setattr(producer, "dict_cursor", lambda c: HolderFinishesMeanwhile(real(c)))
    results = enqueue_many(conn, [("t.ok", {"n": 1}), ("t.ok", {"n": 2}, {"dedup_key": "k"})])
    conn.commit()
    assert finished and [r.created for r in results] == [True, True] and results[1].id != holder
    live = conn.execute("SELECT id FROM job_queue WHERE dedup_key = 'k' AND state = 'queued'").fetchall()
    assert [r["id"] for r in live] == [results[1].id]


def test_concurrent_batches_sharing_dedup_keys_in_other_orders_do_not_deadlock(dsn: str) -> None:
    keys = [f"order:{i}" for i in range(3000)]
    barrier = threading.Barrier(2)
    outcome: dict[str, str] = {}

    def produce(name: str, order: list[str]) -> None:
        with db.connect(dsn) as c:
            barrier.wait()
            try:
                with c.transaction():
                    results = enqueue_many(c, [("t.ok", {}, {"dedup_key": k}) for k in order])
                outcome[name] = f"created {sum(r.created for r in results)}"
            except psycopg.Error as e:
                outcome[name] = type(e).__name__

    threads = [threading.Thread(target=produce, args=args) for args in (("A", keys), ("B", keys[::-1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcome.values()) == ["created 0", "created 3000"], outcome  # before: DeadlockDetected
