"""Optimistic writes in the job's transaction: update a row only if its version is the one you read,
else raise a transient conflict so the job retries with backoff and reads again. No update is lost and
nothing waits on a lock held across the handler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from worker_core.db import Conn
from worker_core.errors import PermanentError, TransientError


class VersionConflict(TransientError):
    """Someone else changed the row since it was read."""


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
    if not where or not changes:
        raise ValueError("versioned_update needs a key (where) and changes")
    if expected_version is None or any(v is None for v in where.values()):
        # "= NULL" matches no row: every attempt would be a conflict, retried until the budget is spent
        raise PermanentError(f"versioned_update on {table}: a key or the expected version is None ({dict(where)})")
    version = sql.Identifier(version_column)
    assignments = [sql.SQL("{} = {}").format(sql.Identifier(k), sql.Placeholder(f"set_{k}")) for k in changes]
    assignments.append(sql.SQL("{v} = {v} + 1").format(v=version))
    conditions = [sql.SQL("{} = {}").format(sql.Identifier(k), sql.Placeholder(f"key_{k}")) for k in where]
    conditions.append(sql.SQL("{} = {}").format(version, sql.Placeholder("expected_version")))
    query = sql.SQL("UPDATE {table} SET {assignments} WHERE {conditions} RETURNING {version}").format(
        table=sql.Identifier(*table.split(".")),
        assignments=sql.SQL(", ").join(assignments),
        conditions=sql.SQL(" AND ").join(conditions),
        version=version,
    )
    params: dict[str, Any] = {f"set_{k}": v for k, v in changes.items()}
    params.update({f"key_{k}": v for k, v in where.items()})
    params["expected_version"] = expected_version
    row = tx.execute(query, params).fetchone()
    if row is None:
        raise VersionConflict(f"{table} {dict(where)} is no longer at version {expected_version}")
    return int(row[version_column])
