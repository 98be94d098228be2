"""Pictures of every screen at 80x24 and 120x36, over the fake backend (fixed data, ids and clock).

Plain ``def`` tests: snap_compare runs its own event loop. Update with ``pytest --snapshot-update`` and
review the report; the SVGs change with the Textual version, which pyproject pins.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from tests.qconsole.conftest import FakeBackend, fake_app
from tests.qconsole.pilot import settle

SIZES = [(80, 24), (120, 36)]
SIZE_IDS = ["80x24", "120x36"]


def keys(*presses: str) -> Callable[[Pilot[Any]], Awaitable[None]]:
    """Settle, press each key and settle again after each one."""

    async def run(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        for key in presses:
            await pilot.press(key)
            await settle(pilot)

    return run


sized = pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)


@sized
def test_overview(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=settle)


@sized
def test_overview_cursor_on_paused_queue(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("down", "down", "down"))


@sized
def test_jobs(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("j"))


@sized
def test_jobs_drilled_from_overview(snap_compare: Any, size: tuple[int, int]) -> None:
    # enter on the first overview row: the jobs of email.send in queue default
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("enter"))


@sized
def test_job_detail_dead(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("j", "enter"))


@sized
def test_job_detail_running_with_lease_and_lock(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("j", "down", "enter"))


@sized
def test_dead_letters_marked(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("d", "space", "space"))


@sized
def test_confirm_requeue(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("d", "space", "space", "r"))


@sized
def test_charts(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("c"))


@sized
def test_workers(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("w"))


@sized
def test_workers_crashed_embedded_output(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("w", "down"))


@sized
def test_start_worker_form(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("w", "s"))


@sized
def test_audit(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("a"))


@sized
def test_help(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("question_mark"))


@sized
def test_outage_banner(snap_compare: Any, size: tuple[int, int]) -> None:
    backend = FakeBackend()
    app = fake_app(backend)

    async def run(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        backend.fail_reads = True
        app.clock.advance(42)  # type: ignore[attr-defined]
        await pilot.press("ctrl+r")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run)


@sized
def test_stale_data_banner(snap_compare: Any, size: tuple[int, int]) -> None:
    # the database answers the reads with an error (a statement timeout behind a table lock): reachable, and the
    # figures shown are the last ones read
    backend = FakeBackend()
    app = fake_app(backend)

    async def run(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        backend.refuse_reads = True
        app.clock.advance(42)  # type: ignore[attr-defined]
        await pilot.press("ctrl+r")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run)


@sized
def test_read_only_refusal(snap_compare: Any, size: tuple[int, int]) -> None:
    app = fake_app(FakeBackend(read_only=True))
    assert snap_compare(app, terminal_size=size, run_before=keys("d", "r"))


@sized
def test_job_type_contracts(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(fake_app(), terminal_size=size, run_before=keys("t", "down", "down"))
