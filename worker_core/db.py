"""Connections: DSN resolution, psycopg 3 connections with dict rows and a named application.

DSN resolution everywhere (CLI, console, workers, tests): an explicit ``--dsn``, then ``QCONSOLE_DSN``,
then ``DATABASE_URL``, else the embedded PostgreSQL server (worker_core.embedded).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

DSN_ENV_VARS = ("QCONSOLE_DSN", "DATABASE_URL")
Conn = psycopg.Connection[dict[str, Any]]
#: a connection of the application's, whatever its row factory (the producer API takes one)
AnyConn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[dict[str, Any]]


def dict_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[dict[str, Any]]:
    """A cursor of dict rows on any connection. The producer API takes the application's own connection,
    whose rows are tuples unless it chose otherwise: worker_core's statements read their results through
    this, never through ``conn.execute``."""
    return conn.cursor(row_factory=dict_row)


def configured_dsn(dsn: str | None = None) -> str | None:
    """The DSN the user configured, or None when the embedded server should be used."""
    if dsn:
        return dsn
    for var in DSN_ENV_VARS:
        value = os.environ.get(var)
        if value:
            return value
    return None


def resolve_dsn(dsn: str | None = None) -> str:
    """A DSN to connect to: the configured one, or the embedded server's (started or attached to)."""
    configured = configured_dsn(dsn)
    if configured:
        return configured
    from worker_core.embedded import start_embedded

    return start_embedded()


#: a URL's user part up to the ``:`` its password begins after
_URL_USER = re.compile(r"://[^:/@\s]*:")
#: ``?password=...`` in a URL's query string, and ``password=...`` in a key=value DSN libpq cannot parse
_PASSWORD_PARAM = re.compile(r"((?:^|[?&\s])password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]*)", re.IGNORECASE)


def _mask_url(word: re.Match[str]) -> str:
    """A word with a URL's password masked, to the word's last ``@`` (a password with an ``@`` of its own,
    unencoded, showed its tail). Word by word, each read once: a regular expression spanning from the
    ``://`` to the last ``@`` took quadratic time on a long word of ``://x:`` with no ``@``."""
    text = word.group(0)
    at = text.rfind("@")
    user = _URL_USER.search(text, 0, at) if at > 0 else None
    return text if user is None else text[: user.end()] + "***" + text[at:]


def _mask(text: str) -> str:
    return _PASSWORD_PARAM.sub(r"\1***", re.sub(r"\S+", _mask_url, text) if "://" in text else text)


def redact_dsn(dsn: str) -> str:
    """The DSN without its password (in the URL's user part or its query string), safe for logs, errors
    and the console."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return _mask(dsn)
    if "password" in params:
        params["password"] = "***"
    if "://" in dsn:
        return _mask(dsn)
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


def _passwords_of(dsn: str) -> list[str]:
    """What may be the DSN's password, longest first: libpq's reading of it, and the URL's user part up to
    its last ``@`` with its pieces (an unencoded ``@`` in a password sends its tail into the host name, an
    unencoded ``%`` fails the parse, and libpq's error quotes that piece)."""
    found: set[str] = set()
    try:
        if password := conninfo_to_dict(dsn).get("password"):
            found.add(str(password))
    except psycopg.ProgrammingError:
        if param := _PASSWORD_PARAM.search(dsn):
            found.add(param.group(2).strip("'"))
    if url := re.search(r"://[^:/@\s]*:([^\s]*)@", dsn):
        found.add(url.group(1))
        found.update(piece for piece in url.group(1).split("@") if len(piece) >= 2)
    return sorted((p for p in found if p), key=len, reverse=True)


def redact(text: str, dsn: str | None) -> str:
    """Remove a DSN's password from an error message (and any DSN in it, whole or in part). A password
    shorter than 4 characters is masked only where no letter, digit or dot touches it: masked everywhere, a
    password ``1`` turned ``127.0.0.1`` into ``***27.0.0.***`` in every message."""
    for password in _passwords_of(dsn) if dsn else ():
        if len(password) < 4:
            text = re.sub(rf"(?<![\w.]){re.escape(password)}(?![\w.])", "***", text)
        else:
            text = text.replace(password, "***")
    return _mask(text)


#: libpq's TCP keepalives and user timeout, where the DSN sets none of its own: a server that vanished (a
#: failover, a cut network, a host powered off) is noticed in about half a minute. Without them a
#: connection waiting for a reply waits for ever (the kernel gives up only on data it is still sending),
#: and a heartbeat or a completer stuck so would let every lease of its worker run out. Ignored over Unix
#: sockets. A long statement is not affected: a live server's kernel answers the probes meanwhile.
TCP_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "15",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


#: the statements of a worker's own connections (claims, beats, settlements), all short: one stuck longer
#: (waiting on a lock an operator's open transaction holds, say) fails, is logged and is tried again,
#: rather than hang its thread while the leases it should extend run out
OWN_STATEMENT_TIMEOUT_MS = 30_000


def _tcp_defaults(dsn: str) -> dict[str, Any]:
    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return {}  # the connection attempt reports what is wrong with it
    return {k: v for k, v in TCP_DEFAULTS.items() if k not in given}


def _options(
    dsn: str, statement_timeout_ms: int | None, read_only: bool, jit: bool = True, lock_timeout_ms: int | None = None
) -> str | None:
    """Server settings for the connection, after the DSN's own ``options``, else ``$PGOPTIONS``: the keyword
    replaces both in libpq (a ``search_path`` set in ``PGOPTIONS`` held on a worker's job connections and
    not on its own, nor on the console's or the CLI's)."""
    opts = []
    try:
        given = conninfo_to_dict(dsn).get("options")
    except psycopg.ProgrammingError:
        given = None
    if given is None:
        given = os.environ.get("PGOPTIONS")
    if given:
        opts.append(str(given))
    if statement_timeout_ms:
        opts.append(f"-c statement_timeout={int(statement_timeout_ms)}")
    if lock_timeout_ms:
        opts.append(f"-c lock_timeout={int(lock_timeout_ms)}")
    if read_only:
        opts.append("-c default_transaction_read_only=on")
    if not jit:
        opts.append("-c jit=off")
    return " ".join(opts) or None


def connect(
    dsn: str,
    *,
    application_name: str = "worker_core",
    autocommit: bool = False,
    statement_timeout_ms: int | None = None,
    lock_timeout_ms: int | None = None,
    read_only: bool = False,
    connect_timeout: int = 5,
    cls: type[Conn] = psycopg.Connection,
    jit: bool = True,
    tolerant_json: bool = False,
) -> Conn:
    """A connection with dict rows. ``read_only`` makes every transaction read-only on the server side;
    ``jit=False`` turns the server's JIT compilation off (the console's short reads paid 40-130 ms of it on
    large tables, for nothing); ``tolerant_json``: see read_json. ``lock_timeout_ms``: how long any statement of
    the connection waits for a lock (a table's, a row's) before it fails with LockNotAvailable, where
    ``statement_timeout_ms`` bounds the whole statement."""
    kwargs: dict[str, Any] = {
        "application_name": application_name,
        "connect_timeout": connect_timeout,
        **_tcp_defaults(dsn),
    }
    if statement_timeout_ms or lock_timeout_ms or read_only or not jit:
        kwargs["options"] = _options(dsn, statement_timeout_ms, read_only, jit, lock_timeout_ms)
    try:
        conn = cls.connect(dsn, autocommit=autocommit, row_factory=dict_row, **kwargs)
    except psycopg.OperationalError:
        if not _embedded_revived(dsn):
            raise
        conn = cls.connect(dsn, autocommit=autocommit, row_factory=dict_row, **kwargs)
    if tolerant_json:
        set_json_loads(read_json, conn)
    return conn


def _embedded_revived(dsn: str) -> bool:
    """After a failed connection: whether ``dsn`` is the URI of an embedded server this process started (or
    attached to) that is running again now, started anew if it had died (worker_core.embedded.revive_if_down).
    A process that never started one never loads that module, and is left alone."""
    embedded = sys.modules.get("worker_core.embedded")
    return embedded is not None and bool(embedded.revive_if_down(dsn))


async def _aembedded_revived(dsn: str) -> bool:
    if sys.modules.get("worker_core.embedded") is None:
        return False
    import asyncio

    return await asyncio.to_thread(_embedded_revived, dsn)


#: what read_json gives for JSON Python cannot decode: ``{UNDECODABLE: why}``
UNDECODABLE = "(undecodable)"


def read_json(data: str | bytes) -> Any:
    """JSON as the console and the CLI read it: a value Python cannot decode (nested too deeply, a number of
    more than 4,300 digits: written by another producer than ours) reads as ``{"(undecodable)": why}``.
    Raised, it failed every list the job was in (its queue's, its type's, the failed jobs') until retention
    pruned it; the worker fails such a job on its own (worker._loads_utf8)."""
    try:
        return json.loads(data if isinstance(data, str) else str(data, "utf-8"))
    except RecursionError:
        return {UNDECODABLE: "nested too deeply to decode"}
    except ValueError as e:
        return {UNDECODABLE: str(e)}


async def aconnect(
    dsn: str,
    *,
    application_name: str = "worker_core",
    autocommit: bool = False,
    connect_timeout: int = 5,
    cls: type[AsyncConn] = psycopg.AsyncConnection,
) -> AsyncConn:
    kwargs: dict[str, Any] = {
        "application_name": application_name,
        "connect_timeout": connect_timeout,
        **_tcp_defaults(dsn),
    }
    try:
        return await cls.connect(dsn, autocommit=autocommit, row_factory=dict_row, **kwargs)
    except psycopg.OperationalError:
        if not await _aembedded_revived(dsn):
            raise
        return await cls.connect(dsn, autocommit=autocommit, row_factory=dict_row, **kwargs)


@contextmanager
def connection(dsn: str | None = None, **kwargs: Any) -> Iterator[Conn]:
    """``with connection() as conn:`` on the resolved DSN; closes on exit."""
    conn = connect(resolve_dsn(dsn), **kwargs)
    try:
        yield conn
    finally:
        conn.close()


class Deadline:
    """``with Deadline(conn, seconds):`` a call on ``conn`` still without an answer after ``seconds`` has the
    connection's socket shut down, which fails it at once (``expired`` then says so). A server that stopped
    answering while TCP still acknowledges (hung, or a proxy in front of a dead one) is noticed by neither
    keepalives nor the server's own statement timeout: a reader waited on it for ever. Closing the
    connection from the timer's thread instead would free what libpq, in the call, still uses."""

    def __init__(self, conn: Conn, seconds: float) -> None:
        self.conn = conn
        self.seconds = seconds
        self.expired = False
        self._lock = threading.Lock()
        self._done = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._done = True

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return  # it answered meanwhile
            self.expired = True
            shut_down(self.conn)


def shut_down(conn: Conn) -> None:
    """Shut the connection's socket down (from any thread): a call waiting on it fails at once."""
    # a duplicate of the descriptor: shutdown acts on the socket itself, close on the copy
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)
