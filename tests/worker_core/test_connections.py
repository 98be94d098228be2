"""Connections (worker_core.db): what every connection of a worker or of the console is opened with."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import running_worker, wait_for
from worker_core import db
from worker_core.execution import JobConnection


def _conninfo(conn: db.Conn) -> dict[str, str]:
    return {o.keyword.decode(): (o.val or b"").decode() for o in conn.pgconn.info}


def test_tcp_keepalives_unless_the_dsn_sets_its_own(dsn: str) -> None:
    with db.connect(dsn) as conn:
        info = _conninfo(conn)
    assert {k: info[k] for k in db.TCP_DEFAULTS} == db.TCP_DEFAULTS
    with db.connect(make_conninfo(dsn, keepalives_idle="99", tcp_user_timeout="1234")) as conn:
        info = _conninfo(conn)
    assert (info["keepalives_idle"], info["tcp_user_timeout"], info["keepalives_count"]) == ("99", "1234", "3")


def test_async_connections_too(dsn: str) -> None:
    async def options() -> dict[str, str]:
        aconn = await db.aconnect(dsn)
        try:
            return {o.keyword.decode(): (o.val or b"").decode() for o in aconn.pgconn.info}
        finally:
            await aconn.close()

    assert asyncio.run(options())["keepalives_idle"] == db.TCP_DEFAULTS["keepalives_idle"]


def test_the_dsns_own_server_options_are_kept_beside_the_ones_a_connection_adds(dsn: str) -> None:
    given = make_conninfo(dsn, options="-c search_path=from_dsn,public")
    with db.connect(given, statement_timeout_ms=1500, read_only=True) as conn:
        shown = [conn.execute(f"SHOW {name}").fetchone() for name in ("search_path", "statement_timeout")]  # type: ignore[call-overload]
        ro = conn.execute("SHOW default_transaction_read_only").fetchone()
    assert [next(iter(r.values())) for r in shown if r] == ["from_dsn,public", "1500ms"]
    assert ro == {"default_transaction_read_only": "on"}
    assert conninfo_to_dict(given)["options"] == "-c search_path=from_dsn,public"


def test_pgoptions_holds_on_connections_that_add_server_options(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # libpq's `options` keyword replaces $PGOPTIONS: a search_path set there held on a worker's job connections
    # and not on its own connections (statement timeout), the console's or the CLI's
    monkeypatch.setenv("PGOPTIONS", "-c search_path=from_env,public")
    for kwargs in ({}, {"statement_timeout_ms": 1500}, {"read_only": True}, {"jit": False}):
        with db.connect(dsn, **kwargs) as conn:  # type: ignore[arg-type]
            assert conn.execute("SHOW search_path").fetchone() == {"search_path": "from_env,public"}, kwargs
    given = make_conninfo(dsn, options="-c search_path=from_dsn")  # the DSN's own wins, as in libpq
    with db.connect(given, statement_timeout_ms=1500) as conn:
        assert conn.execute("SHOW search_path").fetchone() == {"search_path": "from_dsn"}


def test_a_workers_own_connections_bound_their_statements(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # claims, beats, settlements (the completer) and housekeeping; not the slots' (the handlers' statements)
    # nor the listener's (it waits for notifications, it runs no statement)
    opened: list[tuple[str, int | None]] = []
    connect = db.connect

    def recording(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cls") is not JobConnection:
            opened.append((threading.current_thread().name, kwargs.get("statement_timeout_ms")))
        return connect(*args, **kwargs)

    monkeypatch.setattr(db, "connect", recording)
    with running_worker(dsn, housekeeping_interval=0.2):  # its rounds after the first, on connections of their own
        wait_for(lambda: {name for name, _ in opened} >= {"completer", "housekeeping", "listener"}, 10,
                 what="the worker's own connections")  # fmt: skip
    timeouts = dict(opened)
    assert timeouts.pop("listener") is None
    assert timeouts.pop("housekeeping") == 300_000
    assert set(timeouts.values()) == {db.OWN_STATEMENT_TIMEOUT_MS}  # claims and beats (its thread), completer


def test_a_dsn_libpq_cannot_read_is_still_its_error(dsn: str) -> None:
    try:
        db.connect("host=x port=notaport connect_timeout=1")
    except psycopg.Error as e:
        assert "port" in str(e)
    else:
        raise AssertionError("connected")
