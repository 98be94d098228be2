"""worker_core fixtures on top of tests/conftest.py.

``dsn`` is overridden so that every test database also has the tables the handlers of
``tests.worker_core.tasks`` write their business effects to (``ledger`` and ``intervals``).
"""

from __future__ import annotations

import pytest

from worker_core import db

EFFECT_TABLES = """
CREATE TABLE IF NOT EXISTS ledger (id serial PRIMARY KEY, job_id uuid NOT NULL, item text, attempt int);
CREATE TABLE IF NOT EXISTS intervals (job_id uuid NOT NULL, started timestamptz NOT NULL, ended timestamptz NOT NULL);
"""


@pytest.fixture
def dsn(dsn: str) -> str:
    with db.connect(dsn, autocommit=True) as c:
        c.execute(EFFECT_TABLES)
    return dsn
