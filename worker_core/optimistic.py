"""Optimistic writes in the job's transaction: update a row only if its version is the one you read,
else raise a transient conflict so the job retries with backoff and reads again. No update is lost and
nothing waits on a lock held across the handler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from worker_core.db import AsyncConn, Conn
from worker_core.errors import PermanentError, TransientError


class VersionConflict(TransientError):
    """Someone else changed the row since it was read."""


def _statement(
    table: str, where: Mapping[str, Any], expected_version: int, changes: Mapping[str, Any], version_column: str
) -> tuple[sql.Composed, list[Any]]:
    if not where or not changes:
        raise ValueError("versioned_update needs a key (where) and changes")
    if version_column in changes:
        raise ValueError(f"versioned_update sets {version_column!r} itself: leave it out of the changes")
    if expected_version is None or any(v is None for v in where.values()):
        # "= NULL" matches no row: every attempt would be a conflict, retried until the budget is spent
        raise PermanentError(f"versioned_update on {table}: a key or the expected version is None ({dict(where)})")
    if isinstance(expected_version, bool) or not isinstance(expected_version, int):
        # 1.5 or NaN matches no version either: a bug of the caller, not a conflict a retry resolves
        raise PermanentError(f"versioned_update on {table}: the expected version must be an integer, "
                             f"not {expected_version!r}")  # fmt: skip
    named = [table, version_column, *changes, *where]
    if any("%" in str(n) for n in named):
        raise ValueError("versioned_update: a table or column name with '%' in it is not supported")
    version = sql.Identifier(version_column)
    # positional placeholders: a column name is an identifier, never part of a placeholder's name (one
    # with ")" in it broke the named ones)
    assignments = [sql.SQL("{} = %s").format(sql.Identifier(k)) for k in changes]
    assignments.append(sql.SQL("{v} = {v} + 1").format(v=version))
    conditions = [sql.SQL("{} = %s").format(sql.Identifier(k)) for k in where]
    conditions.append(sql.SQL("{} = %s").format(version))
    query = sql.SQL("UPDATE {table} SET {assignments} WHERE {conditions} RETURNING {version}").format(
        table=sql.Identifier(*table.split(".")),
        assignments=sql.SQL(", ").join(assignments),
        conditions=sql.SQL(" AND ").join(conditions),
        version=version,
    )
    return query, [*changes.values(), *where.values(), expected_version]


def _new_version(row: Any, table: str, where: Mapping[str, Any], expected_version: int) -> int:
    if row is None:
        raise VersionConflict(f"{table} {dict(where)} is no longer at version {expected_version}")
    return int(next(iter(row.values())) if isinstance(row, Mapping) else row[0])


def versioned_update(
    tx: Conn,
    table: str,
    where: Mapping[str, Any],
    expected_version: int,
    changes: Mapping[str, Any],
    *,
    version_column: str = "version",
) -> int:
    """``UPDATE table SET changes, version = version + 1 WHERE where AND version = expected``.

    Returns the new version; raises VersionConflict when the row moved on (or is gone). Table and column
    names are bound as identifiers, values as parameters."""
    query, params = _statement(table, where, expected_version, changes, version_column)
    return _new_version(tx.execute(query, params).fetchone(), table, where, expected_version)


async def aversioned_update(
    tx: AsyncConn,
    table: str,
    where: Mapping[str, Any],
    expected_version: int,
    changes: Mapping[str, Any],
    *,
    version_column: str = "version",
) -> int:
    """``versioned_update`` for an async handler's ``ctx.tx``."""
    query, params = _statement(table, where, expected_version, changes, version_column)
    cur = await tx.execute(query, params)
    return _new_version(await cur.fetchone(), table, where, expected_version)
