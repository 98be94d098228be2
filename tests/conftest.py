"""Real PostgreSQL for every test: ``QCONSOLE_TEST_DSN`` when set, otherwise the embedded server.

One migrated template database per test session (and xdist worker); each test gets its own
``CREATE DATABASE ... TEMPLATE`` copy, dropped afterwards. Tests may run in any order.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from worker_core import db, policy
from worker_core.migrate import migrate

# the suite must not pick up an operator's database from the environment
for _var in ("QCONSOLE_DSN", "DATABASE_URL"):
    os.environ.pop(_var, None)
# nor a terminal's color settings: the snapshots are pictures in color (a test that needs NO_COLOR sets it)
for _var in ("NO_COLOR", "FORCE_COLOR"):
    os.environ.pop(_var, None)
# nor any other QCONSOLE_* setting (the policy's QCONSOLE_<FIELD> defaults, QCONSOLE_POLICY_FILE, QCONSOLE_PGDATA,
# QCONSOLE_TASKS...) but the suite's own knobs; and its policy file is an empty one, whatever qconsole.toml or
# pyproject.toml the working directory holds. The processes the tests start inherit all of it.
SUITE_KNOBS = ("QCONSOLE_TEST_", "QCONSOLE_CHAOS_JOBS")
for _var in [v for v in os.environ if v.startswith("QCONSOLE_") and not v.startswith(SUITE_KNOBS)]:
    del os.environ[_var]
os.environ["QCONSOLE_POLICY_FILE"] = str(Path(__file__).with_name("policy.toml"))

TEST_PGDATA = Path(os.environ.get("QCONSOLE_TEST_PGDATA", f"/tmp/qc-test-pg-{os.getuid()}"))


def _admin_dsn() -> str:
    dsn = os.environ.get("QCONSOLE_TEST_DSN")
    if dsn:
        return dsn
    from worker_core.embedded import start_embedded, tune_for_tests

    uri = start_embedded(TEST_PGDATA)
    tune_for_tests(uri)
    return uri


def dsn_for(admin_dsn: str, dbname: str) -> str:
    return make_conninfo(admin_dsn, dbname=dbname)


@pytest.fixture(autouse=True)
def _fresh_policy() -> Iterator[None]:
    """Every test starts with the deployment's policy loaded afresh: none leaves its own to the next."""
    policy.set_current(None)
    yield
    policy.set_current(None)


@pytest.fixture(scope="session")
def admin_dsn() -> str:
    return _admin_dsn()


@pytest.fixture(scope="session")
def template_db(admin_dsn: str) -> Iterator[str]:
    name = f"qc_tpl_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    with db.connect(dsn_for(admin_dsn, name)) as conn:
        migrate(conn)
        conn.commit()
    yield name
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    name = f"qc_e_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield dsn_for(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def dsn(admin_dsn: str, template_db: str) -> Iterator[str]:
    """A migrated database of this test's own."""
    name = f"qc_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield dsn_for(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def conn(dsn: str) -> Iterator[db.Conn]:
    c = db.connect(dsn, autocommit=True)
    yield c
    c.close()


@pytest.fixture
def make_job(conn: db.Conn) -> Callable[..., Any]:
    """Enqueue a job with overrides: ``make_job("t.ok", {"n": 1}, max_attempts=2)``."""
    from worker_core.producer import enqueue

    def make(job_type: str = "test.noop", payload: dict[str, Any] | None = None, **envelope: Any) -> uuid.UUID:
        return enqueue(conn, job_type, payload or {}, **envelope).id

    return make
