"""stats.list_jobs(after=job): the page after a job, in either order, through the first page's indexes.

The console and ``qconsole jobs --after`` read a backlog page by page: without it, the middle of a
backlog of 100,000 jobs was out of every list's reach (the first 200 of each order only).
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from psycopg import sql

from worker_core import FixedClock, db, enqueue, stats
from worker_core.models import Job

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _pages(conn: db.Conn, size: int, **filters: object) -> list[list[uuid.UUID]]:
    pages: list[list[uuid.UUID]] = []
    after: Job | None = None
    while True:
        page = stats.list_jobs(conn, limit=size, after=after, **filters)  # type: ignore[arg-type]
        if not page:
            return pages
        pages.append([j.id for j in page])
        after = page[-1]
        assert len(pages) < 100, "paging does not end"


def _mixed_history(conn: db.Conn) -> list[uuid.UUID]:
    """40 jobs in every source, many sharing an updated_at (a batch settles hundreds at one timestamp)."""
    ids = [enqueue(conn, "t.ok", {"n": i}, clock=FixedClock(NOW)).id for i in range(40)]
    states = ["succeeded", "running", "queued", "dead_lettered", "retry_scheduled", "cancelled", "failed"]
    for i, job_id in enumerate(ids):
        state = states[i % len(states)]
        at = NOW + dt.timedelta(seconds=i % 5)  # eight jobs per timestamp
        finished = at if state in ("succeeded", "dead_lettered", "cancelled", "failed") else None
        conn.execute(
            "UPDATE job_queue SET state = %s, updated_at = %s, finished_at = %s WHERE id = %s",
            (state, at, finished, job_id),
        )
    return ids


@pytest.mark.parametrize("size", [1, 3, 7, 40])
def test_pages_of_the_newest_first_list_are_the_whole_list_cut_in_pieces(conn: db.Conn, size: int) -> None:
    ids = _mixed_history(conn)
    whole = [j.id for j in stats.list_jobs(conn, limit=1000)]
    assert sorted(whole) == sorted(ids)
    pages = _pages(conn, size)
    assert [j for page in pages for j in page] == whole  # each job once, in the list's order, ties included
    assert all(len(page) == size for page in pages[:-1])


@pytest.mark.parametrize("state", ["queued", "running", "succeeded", "dead_lettered"])
def test_pages_under_a_state_filter(conn: db.Conn, state: str) -> None:
    _mixed_history(conn)
    whole = [j.id for j in stats.list_jobs(conn, state=state, limit=1000)]
    assert whole
    assert [j for page in _pages(conn, 2, state=state) for j in page] == whole


def test_pages_of_the_claim_order(conn: db.Conn) -> None:
    ids = [
        enqueue(conn, "t.ok", {"n": i}, priority=i % 3, scheduled_at=NOW - dt.timedelta(seconds=i % 4)).id
        for i in range(30)
    ]
    whole = [j.id for j in stats.list_jobs(conn, next_first=True, limit=1000)]
    assert sorted(whole) == sorted(ids)
    pages = _pages(conn, 4, next_first=True)
    assert [j for page in pages for j in page] == whole
    assert [j for page in _pages(conn, 4, next_first=True, queue="nowhere") for j in page] == []


def test_a_page_stays_put_while_the_job_it_follows_moves_on(conn: db.Conn) -> None:
    # the page is anchored on the job as it was read: when that job runs a moment later (its updated_at
    # and state change), the next page is still the one after it, not the head of the list again
    ids = [enqueue(conn, "t.ok", {"n": i}, clock=FixedClock(NOW + dt.timedelta(seconds=i))).id for i in range(6)]
    first = stats.list_jobs(conn, limit=2)
    assert [j.id for j in first] == [ids[5], ids[4]]
    conn.execute(
        "UPDATE job_queue SET state = 'running', updated_at = now() + interval '1 hour' WHERE id = %s", (ids[4],)
    )
    assert [j.id for j in stats.list_jobs(conn, limit=2, after=first[-1])] == [ids[3], ids[2]]
    first = stats.list_jobs(conn, limit=2, next_first=True)
    conn.execute("UPDATE job_queue SET priority = 9 WHERE id = %s", (first[-1].id,))
    later = stats.list_jobs(conn, limit=10, next_first=True, after=first[-1])
    assert [j.id for j in later][:3] == [ids[2], ids[3], ids[5]] and later[-1].id == first[-1].id


def test_a_search_is_not_paged(conn: db.Conn) -> None:
    job = enqueue(conn, "t.ok", {})
    with pytest.raises(ValueError, match="not paged"):
        stats.list_jobs(conn, search="boom", after=stats.get_job(conn, job.id))


def test_a_deep_page_costs_what_the_first_does(conn: db.Conn) -> None:
    # keyset paging: each source's index walk starts at the page's anchor; no sort, no offset to skip
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, updated_at)"
        " SELECT 't.ok', 'default', '{}', CASE WHEN i % 2 = 0 THEN 'queued' ELSE 'succeeded' END,"
        " CASE WHEN i % 2 = 0 THEN NULL ELSE now() - i * interval '1 ms' END, now() - i * interval '1 ms'"
        " FROM generate_series(1, 40000) AS i"
    )
    conn.execute("ANALYZE job_queue")
    middle = stats.list_jobs(conn, limit=10_000)[-1]
    for order in ({}, {"next_first": True}, {"state": "succeeded"}):
        query, params = stats.list_jobs_query(limit=200, after=middle, **order)  # type: ignore[arg-type]
        rows = conn.execute(sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + query, params).fetchone()
        assert rows is not None
        plan = rows["QUERY PLAN"][0]["Plan"]

        def read(node: dict[str, object]) -> int:
            own = int(node.get("Actual Rows", 0)) if "Scan" in str(node.get("Node Type")) else 0  # type: ignore[call-overload]
            return own + sum(read(child) for child in node.get("Plans", []))  # type: ignore[union-attr]

        assert read(plan) <= 600, (order, plan)  # 200 a source at most, ties aside: not the 20,000 before it
