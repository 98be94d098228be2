"""The policy registry: deployment defaults set once, per-queue and per-type overrides that must carry a
reason, and the effective contract of each type with where each value comes from."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qconsole.cli import app
from worker_core import db, policy
from worker_core.policy import PolicyError
from worker_core.producer import enqueue, enqueue_many
from worker_core.registry import Registry, Task
from worker_core.retry import RetryPolicy

POLICY = """
[tool.qconsole.defaults]
max_attempts = 7
timeout_seconds = 30
backoff = "linear"

[tool.qconsole.queues.billing]
max_attempts = 12
reason = "the payment provider has long outages"
"""


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[policy.DeploymentPolicy]:
    path = tmp_path / "pyproject.toml"
    path.write_text(POLICY)
    loaded = policy.load(path, environ={"QCONSOLE_JITTER": "0"})
    policy.set_current(loaded)
    yield loaded
    policy.set_current(None)


def handler(ctx: object, payload: object) -> None: ...


def test_an_override_without_a_reason_is_refused_at_registration() -> None:
    with pytest.raises(PolicyError, match="without a reason"):
        Registry().register(Task("x.no_reason", handler, max_attempts=9))
    with pytest.raises(PolicyError, match="without a reason"):
        Registry().register(Task("x.blank_reason", handler, retry=RetryPolicy(jitter=0), reason="  "))
    Registry().register(Task("x.plain", handler))  # inheriting everything needs no reason


@pytest.mark.parametrize("field", ["timeout", "visibility_timeout"])
def test_a_task_timeout_of_the_wrong_type_is_refused_not_converted(field: str) -> None:
    # float(True) ran before any check: @task(timeout=True) registered a type whose jobs timed out after 1 s
    for wrong in (True, "30"):
        with pytest.raises(ValueError, match=rf"^@task\('x.wrong'\): {field} must be a finite number, not {wrong!r}$"):
            Registry().register(Task("x.wrong", handler, reason="it is quick", **{field: wrong}))


def test_a_queue_override_without_a_reason_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "qconsole.toml"
    path.write_text("[queues.mail]\nmax_attempts = 3\n")
    with pytest.raises(PolicyError, match=r"\[queues.mail\] overrides max_attempts without a reason"):
        policy.load(path, environ={})
    path.write_text("[defaults]\nmax_retries = 3\n")
    with pytest.raises(PolicyError, match="unknown policy fields max_retries"):
        policy.load(path, environ={})
    path.write_text("[defaults]\ntimeout_seconds = 100\nvisibility_timeout_seconds = 101\n")
    with pytest.raises(PolicyError, match="not a valid contract"):
        policy.load(path, environ={})


WRONG_TYPES = [
    ("max_attempts = 2.9", "max_attempts must be an integer, not 2.9"),
    ("max_attempts = true", "max_attempts must be an integer, not True"),
    ('max_attempts = "8.5"', "max_attempts must be an integer, not '8.5'"),
    ("timeout_seconds = true", "timeout_seconds must be a number, not True"),
    ("backoff = 5", "backoff must be a string, not 5"),
]


@pytest.mark.parametrize(("toml", "error"), WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_a_policy_value_of_the_wrong_type_is_refused_not_converted(tmp_path: Path, toml: str, error: str) -> None:
    # int() truncated it: max_attempts = 2.9 loaded as 2, max_attempts = true as 1 (one attempt for every job)
    path = tmp_path / "qconsole.toml"
    path.write_text(f"[defaults]\n{toml}\n")
    with pytest.raises(PolicyError, match=f"^{re.escape(f'{path} [defaults]: {error}')}$"):
        policy.load(path, environ={})
    with pytest.raises(PolicyError, match=r"^\$QCONSOLE_MAX_ATTEMPTS: max_attempts must be an integer, not '2\.9'$"):
        policy.from_mapping({}, "built-in", environ={"QCONSOLE_MAX_ATTEMPTS": "2.9"})
    # an environment variable is text: its digits are an integer
    from_env = policy.from_mapping({}, "built-in", environ={"QCONSOLE_MAX_ATTEMPTS": "8"})
    assert from_env.defaults.values["max_attempts"] == 8


def test_a_pyproject_policy_error_names_its_tables_as_written_there(tmp_path: Path) -> None:
    # `[defaults]` was named for a value under [tool.qconsole.defaults]: no such table in pyproject.toml
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.qconsole.defaults]\nmax_attempts = 2.9\n")
    error = "max_attempts must be an integer, not 2.9"
    with pytest.raises(PolicyError, match=f"^{re.escape(f'{path} [tool.qconsole.defaults]: {error}')}$"):
        policy.load(path, environ={})
    path.write_text("[tool.qconsole.queues.mail]\nmax_attempts = 3\n")
    with pytest.raises(PolicyError, match=re.escape(f"{path} [tool.qconsole.queues.mail] overrides max_attempts")):
        policy.load(path, environ={})
    path.write_text("[tool.qconsole.default]\nmax_attempts = 3\n")
    with pytest.raises(PolicyError, match=re.escape(f"{path}: unknown tables [tool.qconsole.default] (expected")):
        policy.load(path, environ={})


NOT_TABLES = [
    (
        "qconsole.toml",
        "defaults = 5",
        "defaults must be a table (policy fields: max_attempts = 5 under [defaults]), not 5",
    ),
    (
        "qconsole.toml",
        "defaults = 'abc'",
        "defaults must be a table (policy fields: max_attempts = 5 under [defaults]), not 'abc'",
    ),
    ("qconsole.toml", "defaults = ['max_attempts']", "defaults must be a table"),
    (
        "qconsole.toml",
        "[[defaults]]\nmax_attempts = 3",
        "defaults must be a table (policy fields: max_attempts = 5"
        " under [defaults]), not an array of tables [{'max_attempts': 3}]",
    ),
    ("qconsole.toml", "queues = 5", "queues must be a table (a [queues.<name>] per queue), not 5"),
    ("qconsole.toml", "queues = 0", "queues must be a table (a [queues.<name>] per queue), not 0"),
    ("qconsole.toml", "queues = []", "queues must be a table (a [queues.<name>] per queue), not []"),
    (
        "qconsole.toml",
        "[[queues]]\nname = 'billing'",
        "queues must be a table (a [queues.<name>] per queue), not an array of tables [{'name': 'billing'}]",
    ),
    (
        "qconsole.toml",
        "[queues]\nbilling = 3",
        "queues.billing must be a table (policy fields and a reason under [queues.billing]), not 3",
    ),
    ("qconsole.toml", "[queues]\nbilling = 'x'", "queues.billing must be a table"),
    (
        "pyproject.toml",
        "tool = 5",
        "tool must be a table ([tool.qconsole.defaults] and [tool.qconsole.queues.<name>]), not 5",
    ),
    (
        "pyproject.toml",
        "[tool]\nqconsole = 'x'",
        "tool.qconsole must be a table ([tool.qconsole.defaults] and [tool.qconsole.queues.<name>]), not 'x'",
    ),
    (
        "pyproject.toml",
        "[tool.qconsole]\ndefaults = 5",
        "tool.qconsole.defaults must be a table (policy fields:"
        " max_attempts = 5 under [tool.qconsole.defaults]), not 5",
    ),
    (
        "pyproject.toml",
        "[tool.qconsole]\nqueues = 5",
        "tool.qconsole.queues must be a table (a [tool.qconsole.queues.<name>] per queue), not 5",
    ),
    (
        "pyproject.toml",
        "[tool.qconsole.queues]\nbilling = 3",
        "tool.qconsole.queues.billing must be a table (policy"
        " fields and a reason under [tool.qconsole.queues.billing]), not 3",
    ),
]


@pytest.mark.parametrize(("name", "toml", "error"), NOT_TABLES, ids=[f"{n}:{t}" for n, t, _ in NOT_TABLES])
def test_a_policy_entry_that_is_not_a_table_is_refused_with_the_file_and_key(
    tmp_path: Path, name: str, toml: str, error: str
) -> None:
    # a TypeError's or an AttributeError's traceback ('int' object is not iterable, 'int' object has no
    # attribute 'get'); defaults = 'abc' was "unknown policy fields a, b, c", queues = 0 no queues at all
    path = tmp_path / name
    path.write_text(f"{toml}\n")
    with pytest.raises(PolicyError, match=f"^{re.escape(f'{path}: {error}')}"):
        policy.load(path, environ={})


@pytest.mark.parametrize("reason", ["5", "true", "[]", "{}", '["slow"]'])
def test_a_queue_reason_that_is_not_a_string_is_refused(tmp_path: Path, reason: str) -> None:
    # reason = 5 was the reason "5"; reason = {} with no override was taken as none, silently
    path = tmp_path / "qconsole.toml"
    path.write_text(f"[queues.billing]\nmax_attempts = 12\nreason = {reason}\n")
    with pytest.raises(PolicyError, match=f"^{re.escape(f'{path} [queues.billing]: reason must be a string, not ')}"):
        policy.load(path, environ={})


@pytest.mark.parametrize(
    "args",
    [
        ("worker", "--tasks", "tests.worker_core.tasks", "--burst"),
        ("enqueue", "t.ok", "--tasks", "tests.worker_core.tasks"),
        ("policies",),
    ],
    ids=lambda a: a[0],
)
def test_the_cli_refuses_a_policy_entry_that_is_not_a_table_with_exit_2(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    # qconsole worker, enqueue --tasks and policies died with a TypeError's traceback (exit 1)
    path = tmp_path / "qconsole.toml"
    path.write_text("defaults = 5\n")
    monkeypatch.setenv("QCONSOLE_POLICY_FILE", str(path))
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    result = CliRunner().invoke(app, list(args))
    said = f"the deployment's policy is refused: {path}: defaults must be a table"
    assert result.exit_code == 2 and said in result.output, (result.exit_code, result.output, result.exception)


def test_effective_contract_says_where_each_value_comes_from(deployment: policy.DeploymentPolicy) -> None:
    plain = Task("x.plain", handler, queue="default")
    eff = plain.effective()
    assert eff["max_attempts"] == (7, "default")
    assert eff["timeout_seconds"] == (30.0, "default")
    assert eff["visibility_timeout_seconds"] == (60.0, "default")  # timeout + margin
    assert eff["backoff"] == ("linear", "default") and eff["jitter"] == (0.0, "default")  # from the environment

    billing = Task("invoice.generate", handler, queue="billing", timeout=5, reason="invoices are quick")
    eff = billing.effective()
    assert eff["max_attempts"] == (12, "queue:billing")
    assert eff["timeout_seconds"] == (5.0, "type:invoice.generate")
    assert eff["backoff"] == ("linear", "default")


def test_a_partial_retry_override_keeps_the_deployments_other_retry_fields(
    deployment: policy.DeploymentPolicy,
) -> None:
    """``RetryPolicy(base_seconds=5)`` names one field: the backoff and jitter the deployment set stay."""
    slow = Task("x.slow", handler, retry=RetryPolicy(base_seconds=5), reason="the provider throttles")
    eff = slow.effective()
    assert eff["base_seconds"] == (5.0, "type:x.slow")
    assert eff["backoff"] == ("linear", "default") and eff["jitter"] == (0.0, "default")
    assert eff["max_delay_seconds"] == (600.0, "default")
    assert slow.defaults().retry_policy == RetryPolicy("linear", 5.0, 600.0, 0.0)
    # a field given explicitly wins even where it equals the built-in value
    back = Task("x.back", handler, retry=RetryPolicy(backoff="exponential"), reason="doubling suits it")
    assert back.effective()["backoff"] == ("exponential", "type:x.back")
    assert Task("x.none", handler, retry=RetryPolicy()).overrides() == {}


def test_a_job_sent_to_another_queue_takes_that_queues_policy(
    deployment: policy.DeploymentPolicy, conn: db.Conn
) -> None:
    """A registered type enqueued with ``queue=...``: the queue's layer under the type's own overrides."""
    reg = Registry()
    reg.register(Task("x.mail", handler, queue="default", timeout=5, reason="mail is quick"))
    elsewhere = enqueue(conn, "x.mail", {}, queue="billing", registry=reg).id
    home = enqueue(conn, "x.mail", {}, registry=reg).id
    rows = {r["id"]: r for r in conn.execute("SELECT id, queue, max_attempts, timeout_seconds FROM job_queue")}
    assert (rows[elsewhere]["queue"], rows[elsewhere]["max_attempts"], rows[elsewhere]["timeout_seconds"]) == (
        "billing", 12, 5.0,
    )  # fmt: skip
    assert (rows[home]["queue"], rows[home]["max_attempts"], rows[home]["timeout_seconds"]) == ("default", 7, 5.0)


def test_enqueue_applies_the_effective_policy(deployment: policy.DeploymentPolicy, conn: db.Conn) -> None:
    jid = enqueue(conn, "unknown.here", {}, queue="billing").id
    row = conn.execute("SELECT max_attempts, timeout_seconds, retry_policy FROM job_queue WHERE id = %s", (jid,))
    got = row.fetchone()
    assert got is not None
    assert (got["max_attempts"], got["timeout_seconds"], got["retry_policy"]["backoff"]) == (12, 30.0, "linear")


def test_qconsole_policies_lists_the_contract_of_each_type(dsn: str) -> None:
    result = CliRunner().invoke(app, ["policies", "--tasks", "tests.worker_core.tasks", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["job_type"]: r for r in json.loads(result.stdout)["types"]}
    ledger = rows["t.ledger"]
    assert ledger["fields"]["timeout_seconds"] == {"value": 20.0, "source": "type:t.ledger"}
    assert ledger["fields"]["max_attempts"]["source"] == "default"
    assert ledger["reason"] == "tests need fast, bounded retries"
    text = CliRunner().invoke(app, ["policies", "--tasks", "tests.worker_core.tasks"]).stdout
    assert "t.ledger" in text and "type:t.ledger" in text


def test_workers_publish_the_contracts_they_run(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.worker_core.helpers import run_burst

    run_burst(dsn)  # registers tests.worker_core.tasks
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    result = CliRunner().invoke(app, ["policies", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["job_type"]: r for r in json.loads(result.stdout)["types"]}
    assert rows["t.crash"]["fields"]["max_attempts"] == {"value": 2, "source": "type:t.crash"}
    assert rows["t.ok"]["fields"]["timeout_seconds"] == {"value": 60.0, "source": "default"}
    assert rows["t.ledger"]["requires_idempotency_key"] is True
    assert rows["t.ok"]["reported_by"]


def test_a_producer_without_the_handlers_enqueues_under_the_registered_contract(dsn: str, conn: db.Conn) -> None:
    from tests.worker_core.helpers import run_burst

    before = enqueue(conn, "t.crash", {}, registry=Registry()).id  # nothing registered yet: deployment defaults
    conn.execute("UPDATE job_queue SET state = 'cancelled' WHERE id = %s", (before,))
    run_burst(dsn)  # a worker registers the contracts of tests.worker_core.tasks
    from worker_core import producer

    producer._registered_cache.clear()  # the cache would otherwise keep "nothing registered" for a minute
    after = enqueue(conn, "t.crash", {}, registry=Registry()).id
    rows = {r["id"]: r for r in conn.execute("SELECT id, max_attempts, timeout_seconds FROM job_queue")}
    assert (rows[before]["max_attempts"], rows[before]["timeout_seconds"]) == (5, 60.0)
    assert (rows[after]["max_attempts"], rows[after]["timeout_seconds"]) == (2, 2.0)


def test_a_producer_is_told_once_when_a_type_is_neither_its_own_nor_registered(
    dsn: str, conn: db.Conn, caplog: pytest.LogCaptureFixture
) -> None:
    # it took the deployment's defaults (no idempotency key required, 60 s, 5 attempts) and said nothing:
    # only the CLI's enqueue warned
    from tests.worker_core.helpers import run_burst
    from worker_core import producer

    producer._registered_cache.clear()
    producer._warned_unregistered.clear()
    caplog.set_level("WARNING", logger="worker_core.producer")
    enqueue(conn, "t.crash", {}, registry=Registry())
    enqueue_many(conn, [("t.crash", {}), ("t.ok", {})], registry=Registry())
    said = [r.getMessage() for r in caplog.records if r.name == "worker_core.producer"]
    assert len(said) == 2 and "'t.crash' has no @task in this process" in said[0] and "'t.ok'" in said[1]
    assert "deployment's defaults" in said[0]
    conn.execute("UPDATE job_queue SET state = 'cancelled'")  # t.crash ends its process
    run_burst(dsn)  # its workers register it: not said again, nor for a type this process has its @task for
    producer._registered_cache.clear()
    producer._warned_unregistered.clear()
    caplog.clear()
    enqueue(conn, "t.crash", {}, registry=Registry())
    enqueue(conn, "t.brand_new", {})  # tests.worker_core.tasks is imported here: not in its registry either
    assert [r.getMessage()[:26] for r in caplog.records] == ["job type 't.brand_new' has"]


def test_a_producer_without_the_handlers_sends_a_registered_type_to_another_queue(
    dsn: str, conn: db.Conn, deployment: policy.DeploymentPolicy
) -> None:
    """The registered contract's own fields (source type:...) stay; the rest comes from the new queue."""
    from tests.worker_core.helpers import run_burst
    from worker_core import producer

    run_burst(dsn)
    producer._registered_cache.clear()
    jid = enqueue(conn, "t.ledger", {}, queue="billing", idempotency_key="k1", registry=Registry()).id
    got = conn.execute("SELECT queue, max_attempts, timeout_seconds FROM job_queue WHERE id = %s", (jid,))
    row = got.fetchone()
    assert row is not None
    # t.ledger sets its timeout (20 s) itself, which stays; its max_attempts came from the defaults (7),
    # and billing's own (12) applies in billing
    assert (row["queue"], row["max_attempts"], row["timeout_seconds"]) == ("billing", 12, 20.0)


def test_a_registered_types_derived_lease_gives_way_to_another_queues_own(tmp_path: Path) -> None:
    """The contract names the timeout's source for a visibility timeout derived from it: taken for one the
    type set, it overrode the other queue's own (60 s instead of slow's 900) for a producer without @task."""
    from worker_core.producer import _registered_from_contract

    path = tmp_path / "qconsole.toml"
    path.write_text('[queues.slow]\nvisibility_timeout_seconds = 900\nreason = "slow queue"\n')
    policy.set_current(policy.load(path, environ={}))
    try:
        task = Registry().register(Task("x.derived", handler, timeout=30, reason="quick"))
        c = task.contract()
        row = {"job_type": c.job_type, "queue": c.queue, "requires_idempotency_key": False,
               "contract": {k: {"value": v, "source": s} for k, (v, s) in c.fields.items()}}  # fmt: skip
        registered = _registered_from_contract(row)
        assert task.defaults("slow").visibility_timeout_seconds == 900.0
        assert registered.defaults("slow").visibility_timeout_seconds == 900.0
        assert registered.defaults().visibility_timeout_seconds == 60.0  # its own queue: as registered
    finally:
        policy.set_current(None)


def test_a_partial_retry_policy_stays_partial_through_replace_and_at_enqueue(
    deployment: policy.DeploymentPolicy, conn: db.Conn
) -> None:
    import dataclasses

    slower = dataclasses.replace(RetryPolicy(base_seconds=5), jitter=0.1)
    assert slower.overrides() == {"base_seconds": 5, "jitter": 0.1}  # not the built-in backoff and max delay
    # given at enqueue, it names two fields: the deployment's linear backoff stays
    jid = enqueue(conn, "x.unregistered", {}, retry_policy=RetryPolicy(base_seconds=7)).id
    row = conn.execute("SELECT retry_policy FROM job_queue WHERE id = %s", (jid,)).fetchone()
    assert row is not None
    assert row["retry_policy"] == {"backoff": "linear", "base_seconds": 7, "max_delay_seconds": 600.0, "jitter": 0.0}


def test_a_producer_enqueues_on_its_own_plain_psycopg_connection(dsn: str, conn: db.Conn) -> None:
    """The README's producer passes its application's connection: tuple rows, psycopg's default."""
    import psycopg

    from tests.worker_core.helpers import run_burst
    from worker_core import producer
    from worker_core.producer import enqueue_many

    run_burst(dsn)  # registered contracts are read too
    producer._registered_cache.clear()
    with psycopg.connect(dsn) as app_conn:
        with app_conn.transaction():
            app_conn.execute("CREATE TABLE orders (id int)")
            app_conn.execute("INSERT INTO orders VALUES (1)")
            first = enqueue(app_conn, "t.crash", {}, dedup_key="order:1", registry=Registry())
            again = enqueue(app_conn, "t.crash", {}, dedup_key="order:1", registry=Registry())
            many = enqueue_many(app_conn, [("t.ok", {}, {"dedup_key": "order:1"}), ("t.ok", {})])
        assert first.created and not again.created and again.id == first.id
        assert [r.created for r in many] == [False, True] and many[0].id == first.id
    row = conn.execute("SELECT max_attempts FROM job_queue WHERE id = %s", (first.id,)).fetchone()
    assert row is not None and row["max_attempts"] == 2  # t.crash's registered contract
