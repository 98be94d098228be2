"""``Worker.run()`` (and a supervisor, once for its processes) checks the database before it starts, as
``qconsole worker`` does: migrated by this version, writable by this role."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo

import worker_core
from tests.worker_core.helpers import TASKS, config, in_thread
from worker_core import db
from worker_core.errors import WorkerRefused
from worker_core.ops import SchemaState, check_schema
from worker_core.supervisor import Supervisor
from worker_core.worker import Worker, WorkerConfig

# --------------------------------------------------------------------- Worker.run(): the database checked


def test_a_worker_on_an_unmigrated_database_refuses_to_start(empty_dsn: str) -> None:
    # a non-burst Worker logged failed claims and beat every second, for ever; the CLI refused (exit 3)
    for burst in (False, True):
        w = Worker(WorkerConfig(dsn=empty_dsn, task_modules=TASKS, burst=burst, poll_interval=0.1))
        t, out = in_thread(w.run)
        t.join(20)
        if t.is_alive():
            w.stop()
            t.join(30)
            pytest.fail("the worker started on an unmigrated database")
        assert isinstance(out[0], worker_core.NotMigrated), out
        assert "the database needs migrations (0001_" in str(out[0]) and "qconsole migrate" in str(out[0])
        assert not [th for th in threading.enumerate() if th.name.startswith(("slot-", "heartbeat"))]


def test_a_worker_on_a_database_migrated_by_another_version_refuses_to_start(conn: db.Conn, dsn: str) -> None:
    conn.execute("UPDATE worker_core_migrations SET checksum = 'another' WHERE version = 1")
    conn.commit()
    with pytest.raises(worker_core.NotMigrated, match="differ from what this database applied"):
        Worker(config(dsn, burst=False)).run()


def test_a_worker_on_a_read_only_session_refuses_to_start(dsn: str) -> None:
    read_only = make_conninfo(dsn, options="-c default_transaction_read_only=on")
    with pytest.raises(WorkerRefused, match="this session is read-only"):
        Worker(config(read_only, burst=False)).run()


@pytest.fixture
def role(conn: db.Conn, dsn: str) -> Iterator[Callable[[str], str]]:
    """``role("SELECT")``: a DSN for a new role granted that on every table (``""``: nothing)."""
    roles: list[str] = []

    def make(grant: str) -> str:
        name = f"qc_role_{uuid.uuid4().hex[:8]}"
        conn.execute(f"CREATE ROLE {name} LOGIN")
        if grant:
            conn.execute(f"GRANT {grant} ON ALL TABLES IN SCHEMA public TO {name}")
        conn.commit()
        roles.append(name)
        return make_conninfo(dsn, user=name)

    yield make
    for name in roles:
        conn.execute(f"DROP OWNED BY {name}")
        conn.execute(f"DROP ROLE {name}")
    conn.commit()


def test_a_worker_as_a_role_that_may_not_write_the_queue_refuses_to_start(dsn: str, role: Any) -> None:
    with pytest.raises(WorkerRefused, match=r"it lacks INSERT on job_queue, UPDATE on job_queue"):
        Worker(config(role("SELECT"), burst=False)).run()
    with pytest.raises(WorkerRefused, match="this role cannot read the queue's tables"):
        Worker(config(role(""), burst=False)).run()


def test_a_supervisor_refuses_before_any_worker_process_starts(empty_dsn: str) -> None:
    sup = Supervisor(config(empty_dsn, task_modules=TASKS), processes=2)
    with pytest.raises(worker_core.NotMigrated):
        sup.run()
    assert sup.children == {}


def test_a_worker_checks_the_database_once_not_in_each_process(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the supervisor checks before its processes start; they do not check again, each
    import worker_core.supervisor as supervisor
    import worker_core.worker as worker

    calls: list[str] = []
    check = worker.check_worker_database
    monkeypatch.setattr(supervisor, "check_worker_database", lambda *a, **k: calls.append("sup") or check(*a, **k))
    sup = Supervisor(config(dsn, task_modules=TASKS), processes=2)
    t, out = in_thread(sup.run)
    t.join(90)
    assert out == [0] and calls == ["sup"]




# --------------------------------------------------------------------- ops.check_schema: the one check


def test_the_one_schema_check_says_what_it_found(conn: db.Conn, empty_dsn: str) -> None:
    # the CLI (before every command, the console's start) and Worker.run() each had a check of their own
    with db.connect(empty_dsn, autocommit=True) as empty, pytest.raises(worker_core.NotMigrated) as raised:
        check_schema(empty)
    assert raised.value.pending and raised.value.pending[0].label.startswith("0001_")
    assert "qconsole migrate" in str(raised.value)
    assert check_schema(conn) == SchemaState()  # nothing to say
    conn.execute("UPDATE worker_core_migrations SET checksum = 'another' WHERE version = 1")
    conn.execute("INSERT INTO worker_core_migrations (version, name, checksum) VALUES (9999, 'later', 'x')")
    state = check_schema(conn, refuse_changed=False)  # an operator's command: warned, not refused
    assert [m.label for m in state.changed] == ["0001_init"] and state.newer == (9999,)
    with pytest.raises(worker_core.NotMigrated, match="differ from what this database applied") as raised:
        check_schema(conn)  # a worker's
    assert [m.label for m in raised.value.changed] == ["0001_init"] and not raised.value.pending

