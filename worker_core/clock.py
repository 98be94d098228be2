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


#: a host clock surely this far from the database server's (its measured difference less half the round trip's
#: time) is corrected (ServerAlignedClock.align)
ALIGN_SECONDS = 1.0
#: and, once corrected, stays so while it is surely this far
ALIGN_RELEASE_SECONDS = 0.5
#: a measure over a longer round trip says nothing: a statement that waited (on a lock, a busy server) reads
#: as skew
ALIGN_MAX_TRIP_SECONDS = 1.0


class ServerAlignedClock:
    """A system clock put onto the database server's time when the two differ by a second or more.

    Leases (``locked_until``), schedules and their comparisons are written in the time of whoever runs the
    statement: a worker whose clock is a minute ahead took live jobs from other workers as expired leases
    (their handlers then ran twice at once), and one a minute behind wrote leases the others found expired.
    A worker measures its host's clock against the server's on each beat (``Worker._check_clock``), the
    console every minute (``align_on``), and calls ``align``: a host surely ALIGN_SECONDS off (less half the
    round trip: a database far away is measured as well) reads the server's time from then on, counted on
    the monotonic clock from the measure, so that the host's clock being stepped (NTP, a VM resumed) does
    not move it until the next measure; within a second (NTP-kept hosts) nothing moves. ``measured``: a
    measure was taken; before it, ``now_on`` and ``statement_now`` read the server's clock, as for a plain
    system clock. A test's FixedClock is never aligned.
    """

    def __init__(self, base: SystemClock | None = None) -> None:
        self.base = base or SystemClock()
        #: seconds the host's clock was ahead of the server's at the last measure (0: not corrected)
        self.offset = 0.0
        self.measured = False
        #: while corrected: the server's time and the monotonic clock at the measure
        self._anchor: tuple[dt.datetime, float] | None = None

    def now(self) -> dt.datetime:
        anchor = self._anchor
        if anchor is None:
            return self.base.now()
        return anchor[0] + dt.timedelta(seconds=time.monotonic() - anchor[1])

    def host_now(self) -> dt.datetime:
        """The host's own clock: what a measure compares with the server's."""
        return self.base.now()

    def align(self, skew: float, trip: float) -> None:
        """``skew``: how far the host's clock is ahead of the server's (negative: behind), measured just now
        over a round trip of ``trip`` seconds (its error: half of it)."""
        if trip > ALIGN_MAX_TRIP_SECONDS:
            return
        self.measured = True
        surely = abs(skew) - trip / 2
        if surely >= ALIGN_SECONDS or (self._anchor is not None and surely >= ALIGN_RELEASE_SECONDS):
            self.offset = skew
            self._anchor = (self.base.now() - dt.timedelta(seconds=skew), time.monotonic())
        else:
            self.offset = 0.0
            self._anchor = None

    def align_on(self, conn: Any) -> float | None:
        """Measure this host's clock against the server of ``conn`` (one round trip) and align to it; the
        measured skew, or None when the round trip was too long to tell."""
        sent = self.base.now()
        started = time.monotonic()
        server = _server_time(conn)
        trip = time.monotonic() - started
        if trip > ALIGN_MAX_TRIP_SECONDS:
            return None
        skew = (sent + dt.timedelta(seconds=trip / 2) - server).total_seconds()
        self.align(skew, trip)
        return skew


def _reads_the_server(clock: Clock) -> bool:
    return isinstance(clock, SystemClock) or (isinstance(clock, ServerAlignedClock) and not clock.measured)


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
    off (a producer's host, a handler's ``single_flight``), no extra round trip for it. An aligned clock (once
    measured) or a test's is asked as it is."""
    return None if _reads_the_server(clock) else clock.now()


def now_on(conn: Any, clock: Clock) -> dt.datetime:
    """``clock``'s time; for the system's clock, the database server's (one round trip): what a one-shot
    command (the CLI's requeue, its stats) writes and compares rows with. A host whose clock ran two minutes
    ahead requeued jobs for two minutes later and read every lag two minutes long. An aligned clock (once
    measured) or a test's is asked as it is."""
    return _server_time(conn) if _reads_the_server(clock) else clock.now()
