"""Driving the console in tests: an event loop per test, and waits on what the app does."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from textual import events
from textual.app import App
from textual.pilot import Pilot

S = TypeVar("S")


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()
        asyncio.set_event_loop(asyncio.new_event_loop())


async def settle(pilot: Pilot[Any]) -> None:
    """Until the app's workers (its reads and actions) are done and the screen has caught up."""
    for _ in range(2):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()


async def opened(pilot: Pilot[Any], key: str, kind: type[S]) -> S:
    """Press ``key`` and return the screen it opened, once its reads are done, checked to be a ``kind``."""
    await pilot.press(key)
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, kind), f"{key!r} opened {type(screen).__name__}, not {kind.__name__}"
    return screen


async def type_fast(pilot: Pilot[Any], text: str) -> None:
    """``text`` as a paste, or a fast typist over SSH, sends it: every key queued before the first is handled."""
    app = pilot.app
    assert app._driver is not None
    for ch in text:
        key = {"/": "slash", " ": "space"}.get(ch, ch)
        event = events.Key(key, ch)
        event.set_sender(app)
        app._driver.send_message(event)
    await settle(pilot)


def title_of(app: App[Any]) -> str:
    """The title bar's text: the screen, the data's time, the marks of actions under way."""
    from qconsole.widgets.chrome import TitleBar

    return str(app.screen.query_one(TitleBar).render())


async def until(pilot: Pilot[Any], condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.1)


def run_as_the_console(coro: Coroutine[Any, Any, None], within: float = 30.0) -> bool:
    """Run ``coro`` as ``qconsole`` runs its app (``asyncio.run``, which joins the default executor's threads,
    Textual's thread workers among them, before it returns), in a thread of its own. Whether it returned
    within ``within`` seconds: a console that quit but went on waiting for a worker did not."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(coro)
        except BaseException as e:  # handed to the test
            failure.append(e)

    t = threading.Thread(target=run, name="console-under-test", daemon=True)
    t.start()
    t.join(within)
    if failure:
        raise failure[0]
    return not t.is_alive()
