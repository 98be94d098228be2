"""Retry policy: backoff fixed, linear or exponential, with a max delay and jitter.

The delay of attempt n (1-based, the attempt that just failed):
  fixed:        base
  linear:       base * n
  exponential:  base * 2 ** (n - 1)
capped at max_delay, then jittered by +-jitter (a fraction), and never above max_delay.

A policy remembers which fields it was given (``given``): ``@task(retry=RetryPolicy(base_seconds=5))``
overrides the base delay only, and the type keeps the deployment's backoff, max delay and jitter.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BACKOFFS = ("fixed", "linear", "exponential")
#: a longer delay would not fit a timestamp once added to "now" (and an infinite one is not JSON)
MAX_RETRY_DELAY_SECONDS = 366 * 86400.0
FIELDS = ("backoff", "base_seconds", "max_delay_seconds", "jitter")
BUILTIN: dict[str, Any] = {"backoff": "exponential", "base_seconds": 2.0, "max_delay_seconds": 600.0, "jitter": 0.2}
_UNSET: Any = object()


def _finite(value: Any) -> bool:
    """A real number, not a bool, that fits a float (10**400 does not: OverflowError, not a clear error)."""
    try:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:
        return False


@dataclass(frozen=True, init=False)
class RetryPolicy:
    backoff: str = BUILTIN["backoff"]
    base_seconds: float = BUILTIN["base_seconds"]
    max_delay_seconds: float = BUILTIN["max_delay_seconds"]
    jitter: float = BUILTIN["jitter"]
    #: the fields given explicitly; the others hold the built-in values. Not part of equality.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __init__(
        self,
        backoff: str = _UNSET,
        base_seconds: float = _UNSET,
        max_delay_seconds: float = _UNSET,
        jitter: float = _UNSET,
        *,
        given: frozenset[str] | None = None,
    ) -> None:
        values = {"backoff": backoff, "base_seconds": base_seconds, "max_delay_seconds": max_delay_seconds,
                  "jitter": jitter}  # fmt: skip
        for name, value in values.items():
            object.__setattr__(self, name, BUILTIN[name] if value is _UNSET else value)
        if given is None:
            named = frozenset(n for n, v in values.items() if v is not _UNSET)
        else:
            # dataclasses.replace(policy, jitter=0.1) passes every field, and ``given`` as it was: a field
            # counts as given if it was, or if it now differs from the built-in value (it was changed)
            named = frozenset(given) | {n for n, v in values.items() if v is not _UNSET and v != BUILTIN[n]}
        object.__setattr__(self, "given", frozenset(named))
        problems = self.problems()
        if problems:
            raise ValueError("invalid retry policy: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.backoff not in BACKOFFS:
            out.append(f"backoff must be one of {', '.join(BACKOFFS)}, not {self.backoff!r}")
        if not (_finite(self.base_seconds) and self.base_seconds >= 0):
            out.append("base_seconds must be a finite number >= 0")
        if not (_finite(self.max_delay_seconds) and 0 <= self.max_delay_seconds <= MAX_RETRY_DELAY_SECONDS):
            out.append(f"max_delay_seconds must be between 0 and {MAX_RETRY_DELAY_SECONDS:g}")
        if not (_finite(self.jitter) and 0 <= self.jitter <= 1):
            out.append("jitter must be between 0 and 1")
        return out

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before the next attempt, after ``attempt`` failed."""
        n = max(1, attempt)
        if self.backoff == "fixed":
            raw = self.base_seconds
        elif self.backoff == "linear":
            raw = self.base_seconds * n
        else:
            raw = self.base_seconds * 2.0 ** min(n - 1, 62)
        capped = min(raw, self.max_delay_seconds)
        if self.jitter:
            r = (rng or random).uniform(-self.jitter, self.jitter)
            capped = capped * (1 + r)
        return max(0.0, min(capped, self.max_delay_seconds))

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    def overrides(self) -> dict[str, Any]:
        """The fields given explicitly, to lay over another policy's."""
        return {name: getattr(self, name) for name in FIELDS if name in self.given}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> RetryPolicy:
        if not data:
            return cls()
        known = {k: data[k] for k in FIELDS if k in data}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown retry policy fields: {', '.join(unknown)}")
        return cls(**known)


DEFAULT_RETRY_POLICY = RetryPolicy()
