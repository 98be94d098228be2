"""Time as a dependency: production code asks a Clock, tests pass a fixed one.

SQL takes "now" as a parameter (``%(now)s``) fed from here, so tests pin time in the database too. The time
that counts is the database server's: leases, schedules and their comparisons are shared by every host, so a
long-running process aligns its system clock to the server's (ServerAlignedClock: workers, the console) and a
one-shot command reads the server's (``now_on``: the CLI's actions and reads).
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any, Protocol


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


#: a host clock this far from the database server's is corrected (ServerAlignedClock.align)
ALIGN_SECONDS = 1.0
#: and, once corrected, stays so until it comes within this
ALIGN_RELEASE_SECONDS = 0.5
#: a measure over a round trip longer than this is too uncertain to move the clock by (its error: half the trip)
ALIGN_MAX_TRIP_SECONDS = 0.2


class ServerAlignedClock:
    """A system clock put onto the database server's time when the two differ by a second or more.

    Leases (``locked_until``), schedules and their comparisons are written in the time of whoever runs the
    statement: a worker whose clock is a minute ahead took live jobs from other workers as expired leases
    (their handlers then ran twice at once), and one a minute behind wrote leases the others found expired.
    A worker measures its clock against the server's on each beat (``Worker._check_clock``) and calls
    ``align`` with the measure: past ALIGN_SECONDS its time is the server's from then on, to within half a
    round trip; within a second (NTP-kept hosts) nothing moves. A test's FixedClock is never aligned.
    """

    def __init__(self, base: SystemClock | None = None) -> None:
        self.base = base or SystemClock()
        #: seconds this host's clock is ahead of the server's, taken off every reading (0: not corrected)
        self.offset = 0.0

    def now(self) -> dt.datetime:
        at = self.base.now()
        return at - dt.timedelta(seconds=self.offset) if self.offset else at

    def align(self, skew: float, trip: float) -> None:
        """``skew``: how far the base clock is ahead of the server's (negative: behind), measured over a round
        trip of ``trip`` seconds."""
        if trip > ALIGN_MAX_TRIP_SECONDS:
            return
        if abs(skew) >= ALIGN_SECONDS or (self.offset and abs(skew) >= ALIGN_RELEASE_SECONDS):
            self.offset = skew
        else:
            self.offset = 0.0

    def align_on(self, conn: Any) -> float | None:
        """Measure this host's clock against the server of ``conn`` (one round trip) and align to it; the
        measured skew, or None when the round trip was too long to tell."""
        sent = self.base.now()
        started = time.monotonic()
        server = _server_time(conn)
        trip = time.monotonic() - started
        if trip > 1.0:
            return None
        skew = (sent + dt.timedelta(seconds=trip / 2) - server).total_seconds()
        self.align(skew, trip)
        return skew


def _server_time(conn: Any) -> dt.datetime:
    """The server's clock; a connection found outside a transaction (and not in autocommit) is left so: the
    caller's next ``conn.transaction()`` must still begin, and commit, one of its own."""
    opened = not conn.autocommit and conn.info.transaction_status == 0  # psycopg.pq.TransactionStatus.IDLE
    row = conn.execute("SELECT clock_timestamp() AS now").fetchone()
    if opened:
        conn.rollback()
    at: dt.datetime = row["now"] if isinstance(row, dict) else row[0]
    return at


def statement_now(clock: Clock) -> dt.datetime | None:
    """A statement's "now" parameter where the SQL reads NULL as the server's clock
    (``coalesce(%(now)s::timestamptz, statement_timestamp())``): None for the system's clock, which may be
    off (a producer's host, a handler's ``single_flight``), no extra round trip for it. A test's or an
    aligned clock is asked as it is."""
    return None if isinstance(clock, SystemClock) else clock.now()


def now_on(conn: Any, clock: Clock) -> dt.datetime:
    """``clock``'s time; for the system's clock, the database server's (one round trip): what a one-shot
    command (the CLI's requeue, its stats) writes and compares rows with. A host whose clock ran two minutes
    ahead requeued jobs for two minutes later and read every lag two minutes long. An aligned or a test's
    clock is asked as it is."""
    return _server_time(conn) if isinstance(clock, SystemClock) else clock.now()
