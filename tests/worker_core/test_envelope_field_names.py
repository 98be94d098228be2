"""What a producer is told of an envelope field name that is not one (the one meant, else the fields there
are); and a delay given as a timedelta, as ``TransientError(retry_in=)`` takes one."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

import tests.worker_core.tasks  # noqa: F401 - the t.* types
from tests.worker_core.helpers import job
from worker_core import EnvelopeError, db, enqueue, enqueue_many
from worker_core.envelope import ENVELOPE_FIELDS

# --- envelope field names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("timeout", "timeout_seconds"),
        ("visibility_timeout", "visibility_timeout_seconds"),
        ("retry", "retry_policy"),
        ("delay", "delay_seconds"),
        ("tenant", "tenant_id"),
        ("trace", "trace_id"),
        ("priorty", "priority"),
        ("idempotencykey", "idempotency_key"),
        ("schedule_at", "scheduled_at"),
    ],
)
def test_an_unknown_envelope_field_names_the_one_meant(tx_conn: db.Conn, given: str, meant: str) -> None:
    """``@task`` takes ``timeout=``, ``visibility_timeout=`` and ``retry=``; the CLI ``--timeout``, ``--delay``,
    ``--tenant``; enqueue wants ``timeout_seconds=``... The refusal said only ``unknown envelope field
    'timeout'``: neither the field meant nor the fields there are."""
    with pytest.raises(EnvelopeError) as raised:
        enqueue(tx_conn, "t.ok", {}, **{given: 5})
    assert raised.value.problems == [f"unknown envelope field {given!r}: did you mean {meant!r}?"]


def test_an_unknown_envelope_field_with_no_close_one_lists_the_fields(tx_conn: db.Conn) -> None:
    with pytest.raises(EnvelopeError) as raised:
        enqueue_many(tx_conn, [("t.ok", {}, {"colour": "red"})])
    (problem,) = raised.value.problems
    assert problem.endswith("unknown envelope field 'colour': the envelope's fields are " + ", ".join(ENVELOPE_FIELDS))


# --- delay_seconds as a timedelta -----------------------------------------------------------------------------


def test_delay_seconds_takes_a_timedelta(tx_conn: db.Conn) -> None:
    res = enqueue(tx_conn, "t.ok", {}, delay_seconds=dt.timedelta(minutes=5))
    got = tx_conn.execute(
        "SELECT extract(epoch FROM scheduled_at - created_at) AS delay FROM job_queue WHERE id = %s", (res.id,)
    ).fetchone()
    assert got is not None and float(got["delay"]) == pytest.approx(300.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"delay_seconds": dt.timedelta(seconds=-1)}, "delay_seconds must not be negative"),
        ({"delay_seconds": dt.timedelta(days=400)}, "delay_seconds must be at most"),
        (
            {"delay_seconds": dt.timedelta(seconds=5), "scheduled_at": dt.datetime.now(dt.timezone.utc)},
            "give scheduled_at or delay_seconds, not both",
        ),
        ({"delay_seconds": "90s"}, "delay_seconds must be a finite number"),
    ],
)
def test_a_bad_delay_is_refused_whatever_its_type(tx_conn: db.Conn, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvelopeError) as raised:
        enqueue(tx_conn, "t.ok", {}, **fields)
    assert any(message in p for p in raised.value.problems), raised.value.problems


def test_a_timedelta_delay_in_a_batch(dsn: str) -> None:
    with db.connect(dsn, autocommit=True) as conn:
        (res,) = enqueue_many(conn, [("t.ok", {}, {"delay_seconds": dt.timedelta(hours=1)})])
    row = job(dsn, res.id)
    assert (row["scheduled_at"] - row["created_at"]) == dt.timedelta(hours=1)
