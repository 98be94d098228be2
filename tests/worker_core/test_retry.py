"""Retry delays: from the policy, within its bounds, never above the max delay (property tests); which errors
are retried at all (their classification)."""

from __future__ import annotations

import builtins
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker_core.errors import JobTimeout, PermanentError, TransientError, classify
from worker_core.retry import RetryPolicy

policies = st.builds(
    RetryPolicy,
    backoff=st.sampled_from(["fixed", "linear", "exponential"]),
    base_seconds=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    max_delay_seconds=st.floats(min_value=0, max_value=1e7, allow_nan=False),
    jitter=st.floats(min_value=0, max_value=1, allow_nan=False),
)


@given(policies, st.integers(min_value=1, max_value=10_000), st.integers())
def test_delay_stays_within_bounds(policy: RetryPolicy, attempt: int, seed: int) -> None:
    delay = policy.delay(attempt, random.Random(seed))
    assert 0 <= delay <= policy.max_delay_seconds
    raw = {"fixed": policy.base_seconds, "linear": policy.base_seconds * attempt}.get(
        policy.backoff, policy.base_seconds * 2.0 ** min(attempt - 1, 62)
    )
    expected = min(raw, policy.max_delay_seconds)
    assert (
        expected * (1 - policy.jitter) - 1e-6
        <= delay
        <= min(expected * (1 + policy.jitter), policy.max_delay_seconds) + 1e-6
    )


@pytest.mark.parametrize(
    ("backoff", "delays"),
    [("fixed", [3, 3, 3, 3]), ("linear", [3, 6, 9, 12]), ("exponential", [3, 6, 12, 20])],
)
def test_backoff_shapes_without_jitter(backoff: str, delays: list[float]) -> None:
    policy = RetryPolicy(backoff=backoff, base_seconds=3, max_delay_seconds=20, jitter=0)
    assert [policy.delay(n) for n in range(1, 5)] == delays


@pytest.mark.parametrize(
    "bad",
    [{"backoff": "fibonacci"}, {"base_seconds": -1}, {"max_delay_seconds": -5}, {"jitter": 1.5}, {"color": "red"}],
)
def test_invalid_policies_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy.from_json(bad)


def test_policy_round_trips_through_json() -> None:
    p = RetryPolicy(backoff="linear", base_seconds=1.5, max_delay_seconds=30, jitter=0.1)
    assert RetryPolicy.from_json(p.to_json()) == p


Group: Any = getattr(builtins, "ExceptionGroup", None)  # Python 3.11+


def group(errors: list[Any]) -> Any:
    """An ExceptionGroup of ``errors``, a list among them a group of its own."""
    return Group("unhandled errors in a TaskGroup", [group(e) if isinstance(e, list) else e for e in errors])


GROUPS = [
    ("a-permanent-leaf", [TransientError("503"), PermanentError("no such invoice")], "permanent"),
    ("a-permanent-leaf-nested", [TransientError("503"), [[PermanentError("gone")]]], "permanent"),
    ("transient-leaves", [TransientError("503"), [TransientError("429")]], "transient"),
    ("transient-and-timeout", [TransientError("503"), JobTimeout("slow")], "transient"),
    ("timeouts-only", [JobTimeout("slow"), [JobTimeout("slower")]], "timeout"),
    ("an-unknown-leaf", [TransientError("503"), KeyError("customer_id")], "unknown"),
]


@pytest.mark.skipif(Group is None, reason="no exception groups before Python 3.11")
@pytest.mark.parametrize(("errors", "kind"), [g[1:] for g in GROUPS], ids=[g[0] for g in GROUPS])
def test_an_exception_group_is_classified_by_its_leaves(errors: list[Any], kind: str) -> None:
    # an asyncio.TaskGroup's ExceptionGroup was "unknown" whatever its children raised: a PermanentError in
    # one of them was retried to its dead letters
    assert classify(group(errors)) == kind
