"""Time as a dependency: production code asks a Clock, tests pass a fixed one.

SQL takes "now" as a parameter (``%(now)s``) fed from here, so tests pin time in the database too.
"""

from __future__ import annotations

import datetime as dt
from typing import Protocol


class Clock(Protocol):
    def now(self) -> dt.datetime: ...


class SystemClock:
    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)


class FixedClock:
    """A clock that only moves when told to."""

    def __init__(self, at: dt.datetime) -> None:
        self._at = at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)

    def now(self) -> dt.datetime:
        return self._at

    def advance(self, seconds: float) -> None:
        self._at += dt.timedelta(seconds=seconds)

    def set(self, at: dt.datetime) -> None:
        self._at = at


SYSTEM_CLOCK = SystemClock()
