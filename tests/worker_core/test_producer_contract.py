"""A producer resolves a job's contract under the deployment's policy, wherever it runs.

README: a type's defaults come "from its @task when --tasks imports it, else from the contract its workers
registered in the database", and "a job sent to another queue than its type's (enqueue(..., queue="bulk"))
takes that queue's layer under the type's own overrides". The workers registered the type's contract in its
own queue only, and the queue layers and deployment defaults were the producer's policy file's: a producer
with none (another service, a script run from another directory) enqueued under the built-in ones. The
workers now register their policy too (deployment_policy, migration 0016), and a producer without a policy
file of its own resolves under it. One with a file of its own keeps it.

Precedence, field by field: the fields given at enqueue > the type's own (its @task, or what its workers
registered) > the queue's layer > the deployment's defaults (< this process's QCONSOLE_<FIELD> variables).
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tests.worker_core.tasks  # noqa: F401 - the t.* types the workers run
from qconsole.cli import app
from tests.worker_core.helpers import job, run_burst
from worker_core import db, enqueue, enqueue_many, policy, producer
from worker_core.registry import Registry, Task

WORKERS_POLICY = """
[defaults]
max_attempts = 7
timeout_seconds = 30

[queues.notify]
max_attempts = 8
visibility_timeout_seconds = 600
reason = "the mail API has long outages"
"""


def handler(ctx: object, payload: object) -> None: ...


def forget() -> None:
    """This process's policy and what it read of the registrations (read at most once a minute)."""
    policy.set_current(None)
    producer._registered_cache.clear()
    producer._policy_cache.clear()


@pytest.fixture
def as_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """Run a burst worker of tests.worker_core.tasks under a policy file of ``text`` (the workers' own)."""

    def run(dsn: str, text: str = WORKERS_POLICY) -> None:
        path = tmp_path / "workers.toml"
        path.write_text(textwrap.dedent(text))
        monkeypatch.setenv("QCONSOLE_POLICY_FILE", str(path))
        forget()
        run_burst(dsn)  # registers the t.* contracts, and the workers' policy

    return run


@pytest.fixture
def producer_without_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Call it once the workers ran: from then on this process is a producer with no policy file of its own
    (another working directory, none named)."""
    here = tmp_path / "producer"
    here.mkdir()

    def become() -> None:
        monkeypatch.delenv("QCONSOLE_POLICY_FILE", raising=False)
        monkeypatch.chdir(here)
        forget()
        assert policy.current().source == "built-in"

    yield become
    forget()


def row(dsn: str, result: Any) -> dict[str, Any]:
    return job(dsn, result.id)


def test_a_job_sent_to_another_queue_takes_that_queues_layer_from_the_workers_policy(
    dsn: str, as_workers: Callable[..., None], producer_without_file: Callable[[], None]
) -> None:
    """The review's finding: [queues.notify] max_attempts = 8 in the workers' policy; a producer that does not
    import the task module enqueues t.ok to notify: the job had the built-in 5."""
    as_workers(dsn)
    producer_without_file()
    with db.connect(dsn) as conn:
        res = enqueue(conn, "t.ok", {}, queue="notify", registry=Registry())
        conn.commit()
    got = row(dsn, res)
    assert (got["queue"], got["max_attempts"], got["visibility_timeout_seconds"]) == ("notify", 8, 600.0)
    assert got["timeout_seconds"] == 30.0  # the workers' [defaults]
    assert got["retry_policy"]["backoff"] == "fixed"  # t.ok's own retry policy (its @task, as registered)


def test_a_producer_that_imports_the_task_module_from_another_directory_takes_the_workers_defaults(
    dsn: str, as_workers: Callable[..., None], producer_without_file: Callable[[], None]
) -> None:
    """Its @task is local, the policy file is not: it enqueued under the built-in max_attempts 5 while the
    workers registered 7."""
    as_workers(dsn)
    producer_without_file()
    with db.connect(dsn, autocommit=True) as conn:
        home = enqueue(conn, "t.ok", {})  # this process imports tests.worker_core.tasks
        notify = enqueue(conn, "t.ok", {}, queue="notify")
        own = enqueue(conn, "t.ledger", {}, idempotency_key="k1")
    assert (row(dsn, home)["max_attempts"], row(dsn, home)["timeout_seconds"]) == (7, 30.0)
    assert row(dsn, notify)["max_attempts"] == 8
    assert row(dsn, own)["timeout_seconds"] == 20.0  # its @task's timeout=20 over the workers' 30


def test_precedence_is_given_fields_then_type_then_queue_then_defaults(
    dsn: str, as_workers: Callable[..., None], producer_without_file: Callable[[], None]
) -> None:
    as_workers(dsn)
    producer_without_file()
    local = Registry()
    local.register(Task("x.prec", handler, queue="default", max_attempts=3, reason="it is cheap to give up"))
    with db.connect(dsn, autocommit=True) as conn:
        typed = enqueue(conn, "x.prec", {}, queue="notify", registry=local)
        given = enqueue(conn, "x.prec", {}, queue="notify", max_attempts=9, timeout_seconds=12, registry=local)
        jobs = [("x.prec", {}, {"queue": "notify"}), ("x.other", {}, {"queue": "notify"})]
        many = enqueue_many(conn, jobs, registry=local)
    typed_row = row(dsn, typed)
    # the type's max_attempts (3) over notify's (8); notify's lease (600) over the default one; defaults' timeout
    assert (typed_row["max_attempts"], typed_row["visibility_timeout_seconds"], typed_row["timeout_seconds"]) == (
        3,
        600.0,
        30.0,
    )
    given_row = row(dsn, given)
    assert (given_row["max_attempts"], given_row["timeout_seconds"]) == (9, 12.0)
    assert given_row["visibility_timeout_seconds"] == 600.0  # notify's, above the given timeout's own 42
    assert [row(dsn, r)["max_attempts"] for r in many] == [3, 8]  # a type nobody registered: the queue's


def test_a_producer_with_a_policy_file_of_its_own_keeps_it(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_workers: Callable[..., None]
) -> None:
    """Documented: this process's policy file wins over the workers' registered one (as a worker's own
    file does); the registered one stands in for a file that is not there. A type's registered contract in
    its own queue is taken as registered, whatever the file."""
    as_workers(dsn)
    mine = tmp_path / "mine.toml"
    mine.write_text('[defaults]\nmax_attempts = 4\n\n[queues.notify]\nmax_attempts = 3\nreason = "ours"\n')
    monkeypatch.setenv("QCONSOLE_POLICY_FILE", str(mine))
    forget()
    with db.connect(dsn, autocommit=True) as conn:
        other_queue = enqueue(conn, "t.ok", {}, queue="notify", registry=Registry())
        imported = enqueue(conn, "t.ok", {})
        registered = enqueue(conn, "t.ok", {}, registry=Registry())
    assert row(dsn, other_queue)["max_attempts"] == 3
    assert row(dsn, imported)["max_attempts"] == 4
    assert row(dsn, registered)["max_attempts"] == 7  # the contract its workers registered, in its queue


def test_a_pyproject_without_qconsole_tables_is_no_policy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A web app run from its project's root has a pyproject.toml with no [tool.qconsole]: taken for a policy
    file (source: its path), it hid the workers' registered policy behind the built-in defaults."""
    monkeypatch.delenv("QCONSOLE_POLICY_FILE", raising=False)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "shop"\n[tool.ruff]\nline-length = 100\n')
    assert policy.find_policy_file(tmp_path) == (None, "none")
    monkeypatch.chdir(tmp_path)
    assert policy.load().source == "built-in"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "shop"\n[tool.qconsole.defaults]\nmax_attempts = 6\n')
    assert policy.find_policy_file(tmp_path) == (tmp_path / "pyproject.toml", "pyproject")
    (tmp_path / "pyproject.toml").write_text("[tool.qconsole\n")  # unreadable: load says why
    assert policy.find_policy_file(tmp_path)[0] == tmp_path / "pyproject.toml"
    with pytest.raises(policy.PolicyError, match="cannot read the policy file"):
        policy.load()


def test_the_producers_own_variables_apply_over_the_workers_defaults(
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    as_workers: Callable[..., None],
    producer_without_file: Callable[[], None],
) -> None:
    """QCONSOLE_<FIELD> overrides the defaults of the file; the registered policy stands in for the file."""
    as_workers(dsn)
    producer_without_file()
    monkeypatch.setenv("QCONSOLE_MAX_ATTEMPTS", "6")
    forget()
    with db.connect(dsn, autocommit=True) as conn:
        home = enqueue(conn, "x.unregistered", {})
        notify = enqueue(conn, "x.unregistered", {}, queue="notify")
    assert (row(dsn, home)["max_attempts"], row(dsn, home)["timeout_seconds"]) == (6, 30.0)
    assert row(dsn, notify)["max_attempts"] == 8  # the queue's layer is above the defaults


def test_before_any_worker_registered_a_policy_the_built_in_one_applies(
    dsn: str, producer_without_file: Callable[[], None]
) -> None:
    producer_without_file()
    with db.connect(dsn, autocommit=True) as conn:
        res = enqueue(conn, "t.ok", {}, queue="notify", registry=Registry())
    assert row(dsn, res)["max_attempts"] == 5


def test_the_registered_policy_is_read_once_a_minute_not_per_enqueue(
    dsn: str, as_workers: Callable[..., None], producer_without_file: Callable[[], None]
) -> None:
    """enqueue is a hot path: the registered policy is cached per process and database for
    REGISTERED_TTL_SECONDS, as the types' contracts are. A worker's new policy reaches producers within it."""
    as_workers(dsn)
    producer_without_file()
    with db.connect(dsn, autocommit=True) as conn:
        first = enqueue(conn, "x.cached", {}, queue="notify")
        conn.execute("UPDATE deployment_policy SET queues = jsonb_set(queues, '{notify,max_attempts}', '11')")
        cached = enqueue(conn, "x.cached", {}, queue="notify")
        for database in list(producer._policy_cache):  # the minute has passed
            producer._policy_cache[database] = (0.0, None)
        later = enqueue(conn, "x.cached", {}, queue="notify")
    assert [row(dsn, r)["max_attempts"] for r in (first, cached, later)] == [8, 8, 11]


def test_a_worker_registers_its_policy_and_says_when_it_replaces_a_different_one(
    dsn: str, as_workers: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker_core")
    as_workers(dsn)
    with db.connect(dsn, autocommit=True) as conn:
        got = conn.execute("SELECT defaults, queues, source, reported_by FROM deployment_policy").fetchall()
    assert len(got) == 1 and got[0]["source"].endswith("workers.toml")
    assert got[0]["defaults"]["max_attempts"] == 7 and "visibility_timeout_seconds" not in got[0]["defaults"]
    assert got[0]["queues"]["notify"] == {
        "max_attempts": 8,
        "visibility_timeout_seconds": 600.0,
        "reason": "the mail API has long outages",
    }
    as_workers(dsn)  # the same policy again: nothing to say
    assert not [r for r in caplog.records if "replaces a different one" in r.getMessage()]
    as_workers(dsn, "")  # a worker started where there is no policy (here: an empty one)
    said = [r.getMessage() for r in caplog.records if "replaces a different one" in r.getMessage()]
    assert len(said) == 1 and "workers.toml, registered by" in said[0], said


def test_qconsole_policies_shows_the_policy_the_workers_registered(
    dsn: str, monkeypatch: pytest.MonkeyPatch, as_workers: Callable[..., None]
) -> None:
    as_workers(dsn)
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    result = CliRunner().invoke(app, ["policies", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert "workers.toml" in out["source"] and "registered by" in out["source"]
    assert out["queues"]["notify"] == {
        "values": {"max_attempts": 8, "visibility_timeout_seconds": 600.0},
        "reason": "the mail API has long outages",
    }
    text = CliRunner().invoke(app, ["policies"]).stdout
    assert "workers.toml" in text and "queue notify" in text and "the mail API has long outages" in text


def test_a_registered_policy_this_producer_cannot_read_is_said_and_the_built_in_one_applies(
    dsn: str,
    as_workers: Callable[..., None],
    producer_without_file: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A newer worker's policy field (a rolling deploy): every enqueue refused would be worse than the
    built-in defaults, said."""
    as_workers(dsn)
    with db.connect(dsn, autocommit=True) as conn:
        conn.execute("""UPDATE deployment_policy SET defaults = defaults || '{"max_runtime_soon": 3}'""")
    producer_without_file()
    caplog.set_level(logging.WARNING, logger="worker_core.producer")
    with db.connect(dsn, autocommit=True) as conn:
        res = enqueue(conn, "x.unregistered", {}, queue="notify")
    assert row(dsn, res)["max_attempts"] == 5
    said = [r.getMessage() for r in caplog.records if "does not apply here" in r.getMessage()]
    assert len(said) == 1 and "max_runtime_soon" in said[0], said
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    result = CliRunner().invoke(app, ["policies", "--json"])
    assert result.exit_code == 0, result.output
    assert "does not read here" in json.loads(result.stdout)["source"] and "max_runtime_soon" in result.stdout
