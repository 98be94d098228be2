"""queries.sql: named blocks, fragments included where ``{{name}}`` stands, never served as queries."""

from __future__ import annotations

import pytest

from worker_core.sql import parse, queries

TEXT = """
-- name: fragment_cols
-- a comment that stays out of the query
a, b
-- name: fragment_select
SELECT {{cols}} FROM t
-- name: one
{{select}} WHERE a = %(a)s;
-- name: two
SELECT 1
"""


def test_fragments_are_expanded_recursively_and_not_served() -> None:
    out = parse(TEXT)
    assert out == {"one": "SELECT a, b FROM t WHERE a = %(a)s", "two": "SELECT 1"}


def test_an_unknown_fragment_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown fragment 'nope'"):
        parse("-- name: q\nSELECT {{nope}}")


def test_a_duplicate_name_is_refused() -> None:
    with pytest.raises(RuntimeError, match="duplicate query name"):
        parse("-- name: q\nSELECT 1\n-- name: q\nSELECT 2")


def test_the_shipped_claims_share_one_update() -> None:
    assert not any("{{" in q for q in queries.values())
    assert not any(name.startswith("fragment_") for name in queries)
    tail = queries["claim"][queries["claim"].index("UPDATE job_queue j SET") :]
    assert queries["claim_limited"].endswith(tail)
    assert "j.errors" not in queries["claim_solo"].split("RETURNING")[-1]
