"""Pure formatting helpers: times, ages, counts and the symbols that carry meaning without color.

>>> ago(dt.datetime(2025, 1, 1, 12, 0, 0), dt.datetime(2025, 1, 1, 12, 3, 5))
'3m05s ago'
>>> duration(42.4)
'42s'
>>> duration(3725)
'1h02m'
>>> rate(0.0)
'-'
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from worker_core.models import ESCAPE_SEQUENCES, JobState

#: state -> (symbol, short name). Symbols let a NO_COLOR terminal tell states apart.
STATE_MARKS: dict[str, tuple[str, str]] = {
    JobState.QUEUED.value: ("·", "queued"),
    JobState.RUNNING.value: ("▶", "running"),
    JobState.RETRY_SCHEDULED.value: ("↻", "retry"),
    JobState.SUCCEEDED.value: ("✓", "succeeded"),
    JobState.FAILED.value: ("✗", "failed"),
    JobState.DEAD_LETTERED.value: ("☠", "dead"),
    JobState.CANCELLED.value: ("⊘", "cancelled"),
}
#: a row over a threshold: shown as a symbol (and colored when color is available)
WARN = "▲"
PAUSED = "⏸"
OK = " "


def limit_mark(limit: int | None) -> str:
    """A job type's concurrency limit, next to its name: ``⏸0`` held (a limit of 0: no worker claims its jobs,
    nor reclaims its expired leases), ``≤N`` at most N running fleet-wide, nothing without a limit.

    >>> limit_mark(0), limit_mark(4), limit_mark(None)
    ('⏸0', '≤4', '')
    """
    if limit is None:
        return ""
    return f"{PAUSED}0" if limit == 0 else f"≤{limit}"


def utc(t: dt.datetime | None) -> dt.datetime | None:
    if t is None:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def duration(seconds: float) -> str:
    """Compact: 9s, 42s, 3m05s, 1h02m, 2d03h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def elapsed(seconds: float) -> str:
    """A short time, to the millisecond below a second: 45ms, 2.1s, 3m05s."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 10:
        return f"{seconds:.1f}s"
    return duration(seconds)


def ago(t: dt.datetime | None, now: dt.datetime) -> str:
    t = utc(t)
    if t is None:
        return "-"
    delta = (utc(now) - t).total_seconds()  # type: ignore[operator]
    if delta < 0:
        return "in " + duration(-delta)
    return duration(delta) + " ago"


def hms(t: dt.datetime | None) -> str:
    """Wall-clock time in UTC: the console is read by people in several time zones at once."""
    t = utc(t)
    return "-" if t is None else t.astimezone(dt.timezone.utc).strftime("%H:%M:%S")


def stamp(t: dt.datetime | None) -> str:
    t = utc(t)
    return "-" if t is None else t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def count(n: int) -> str:
    if n == 0:
        return "-"
    if n >= 100_000:
        return f"{n / 1000:.0f}k"
    return str(n)


def rate(per_min: float) -> str:
    if per_min <= 0:
        return "-"
    if per_min < 10:
        return f"{per_min:.1f}"
    return f"{per_min:.0f}"


#: what else a terminal would act on: C0 controls but tab and newline, DEL, C1 controls
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Job data (errors, keys, payloads) and worker output as the console shows them: escape sequences
    removed, other control characters as U+FFFD. Written to the terminal as they are, they would clear the
    on-call engineer's screen, retitle the window or set the clipboard.

    >>> printable("ok\\x1b[2J\\x1b]0;pwned\\x07 done\\x00")
    'ok done\ufffd'
    """
    return _CONTROLS.sub("\ufffd", ESCAPE_SEQUENCES.sub("", text))


def clip(text: str, width: int) -> str:
    text = " ".join(printable(text).split())
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def clip_middle(text: str, width: int) -> str:
    """One line in at most ``width`` characters, cut in the middle, keeping more of its end, where job types
    and errors that begin alike differ.

    >>> clip_middle("com.example.billing.payments.pay.capture", 19)
    'com.exa…pay.capture'
    >>> clip_middle("email.send", 19)
    'email.send'
    """
    text = " ".join(printable(text).split())
    if len(text) <= width:
        return text
    width = max(width, 3)
    tail = -(-(width - 1) * 3 // 5)  # ceil: the end gets 3/5 of what is kept
    if text[len(text) - tail] in "._-:/ " and tail > 1:  # "com.exam….pay.capture": the cut is at the dot
        tail -= 1
    head = width - 1 - tail
    return text[:head] + "…" + text[len(text) - tail :]


def clip_apart(texts: list[str], width: int) -> list[str]:
    """Each text clipped to ``width``: at its end where that leaves it unlike the others, else in its middle
    (two errors that begin alike read the same, clipped at their ends).

    >>> clip_apart(["PermanentError: invalid VAT id for DE", "PermanentError: invalid VAT id for FR", "x"], 24)
    ['PermanentE…VAT id for DE', 'PermanentE…VAT id for FR', 'x']
    >>> clip_apart(["TransientError: upstream 503 from smtp"] * 2, 24)
    ['TransientError: upstrea…', 'TransientError: upstrea…']
    """
    ends = [clip(t, width) for t in texts]
    # the same text twice (a group's error, dead and still retrying) reads alike, rightly: only different
    # texts that read alike are cut in the middle
    texts_of: dict[str, set[str]] = {}
    for t, e in zip(texts, ends, strict=True):
        texts_of.setdefault(e, set()).add(t)
    return [e if len(texts_of[e]) == 1 else clip_middle(t, width) for t, e in zip(texts, ends, strict=True)]


def short_id(job_id: Any) -> str:
    return str(job_id)[:8]


def pretty_json(value: Any) -> str:
    # json escapes C0 controls in strings, not C1 ones (ensure_ascii=False keeps the rest of Unicode)
    return printable(json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False))


def state_label(state: str) -> str:
    symbol, name = STATE_MARKS.get(state, ("?", state))
    return f"{symbol} {name}"
