"""lock_key leases: a resource that must not be worked on in parallel (``order:ord_987``).

Two backends with one contract: acquire with a token and a TTL, extend and release only with that token,
and a dead holder frees the lease by itself when the TTL runs out.
- PostgreSQL (default): a row in ``resource_locks``, taken with an upsert that only overwrites an expired
  lease.
- Redis (``--lock-backend redis://...``): a single-instance lease, ``SET key token NX PX ttl``; extend and
  release compare the token in a Lua script so nobody frees a lease they do not hold.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, Clock, statement_now
from worker_core.db import Conn
from worker_core.sql import queries


class LockBackend(Protocol):
    name: str

    def acquire(self, conn: Conn, key: str, token: str, ttl: float, job_id: uuid.UUID | None = None) -> bool: ...

    def extend(self, conn: Conn, key: str, token: str, ttl: float) -> bool: ...

    def release(self, conn: Conn, key: str, token: str) -> bool: ...

    def refused(self, e: BaseException) -> bool:
        """Whether ``e`` is the backend's answer refusing a call (its permissions, memory, a read-only
        replica), which the job is charged for in the end, rather than a connection lost on the way (an
        outage, never the job's)."""
        ...


class PostgresLocks:
    """Leases as rows. Each call commits on its own (the connection must not be inside a job transaction)."""

    name = "postgres"

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock

    def refused(self, e: BaseException) -> bool:
        return False  # its errors are the slot connection's (dropped when idle, a failover): never the job's

    def _run(self, conn: Conn, query: str, params: dict[str, Any]) -> bool:
        with conn.transaction():
            row = conn.execute(queries[query], {**params, "now": statement_now(self.clock)}).fetchone()
        return row is not None

    def acquire(self, conn: Conn, key: str, token: str, ttl: float, job_id: uuid.UUID | None = None) -> bool:
        return self._run(conn, "lock_acquire", {"key": key, "token": token, "ttl": ttl, "job_id": job_id})

    def extend(self, conn: Conn, key: str, token: str, ttl: float) -> bool:
        return self._run(conn, "lock_extend", {"key": key, "token": token, "ttl": ttl})

    def release(self, conn: Conn, key: str, token: str) -> bool:
        return self._run(conn, "lock_release", {"key": key, "token": token})


_EXTEND = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class RedisLocks:
    """Single-instance Redis leases (not Redlock: one Redis is the source of truth for the lease)."""

    name = "redis"

    def __init__(self, url: str, prefix: str = "qconsole:lock:") -> None:
        import redis

        self.url = url
        self.prefix = prefix
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._extend = self.client.register_script(_EXTEND)
        self._release = self.client.register_script(_RELEASE)

    def refused(self, e: BaseException) -> bool:
        import redis

        return isinstance(e, redis.exceptions.ResponseError)  # NOPERM, OOM, READONLY, BUSY...

    def acquire(self, conn: Conn, key: str, token: str, ttl: float, job_id: uuid.UUID | None = None) -> bool:
        return bool(self.client.set(self.prefix + key, token, nx=True, px=max(1, int(ttl * 1000))))

    def extend(self, conn: Conn, key: str, token: str, ttl: float) -> bool:
        return bool(self._extend(keys=[self.prefix + key], args=[token, max(1, int(ttl * 1000))]))

    def release(self, conn: Conn, key: str, token: str) -> bool:
        return bool(self._release(keys=[self.prefix + key], args=[token]))


def lock_backend(url: str | None, clock: Clock = SYSTEM_CLOCK) -> LockBackend:
    """``None`` or ``postgres`` for the default backend, ``redis://...`` for Redis."""
    if not url or url in ("postgres", "postgresql", "pg"):
        return PostgresLocks(clock)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisLocks(url)
    # masked: a mistyped redis:// URL still carries its password
    raise ValueError(f"unknown lock backend {db._mask(url)!r}: use 'postgres' or a redis:// URL")


def new_token() -> str:
    return uuid.uuid4().hex


def lease_seconds(visibility_timeout: float) -> float:
    """A resource lease lasts as long as the job's lease; heartbeats extend both."""
    return max(1.0, visibility_timeout)


__all__ = ["LockBackend", "PostgresLocks", "RedisLocks", "lease_seconds", "lock_backend", "new_token"]
