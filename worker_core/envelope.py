"""The envelope: what a producer gives. Validated in full before anything is written.

Every problem is reported at once (a list), so a producer fixes its message in one round trip.
"""

from __future__ import annotations

import datetime as dt
import decimal
import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from worker_core.errors import EnvelopeError
from worker_core.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from worker_core.retry import FIELDS as RETRY_FIELDS

# \Z, not $: Python's $ also matches before a trailing newline, which PostgreSQL's CHECK then refuses
JOB_TYPE_RE = re.compile(r"^[a-z0-9_.-]+\Z")
QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:-]+\Z")
#: an idempotency key names a business effect; a wall-clock time in it makes every retry "new"
TIMESTAMP_IN_KEY_RE = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
#: a NUL character as json.dumps writes it (an escaped backslash followed by "u0000" is not one)
NUL_IN_JSON_RE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

MAX_PAYLOAD_BYTES = 256 * 1024
#: levels of objects and arrays; the worker decodes payloads with the stdlib's recursive json.loads
MAX_PAYLOAD_DEPTH = 100
MAX_KEY_LENGTH = 512
MAX_JOB_TYPE_LENGTH = 200
DEFAULT_QUEUE = "default"
DEFAULT_MAX_ATTEMPTS = 5
#: upper bounds keep every accepted envelope inside PostgreSQL's integer and timestamp ranges: one job with
#: timeout_seconds=1e13 used to make the claim fail with "timestamp out of range" for every worker
MAX_MAX_ATTEMPTS = 1000
MAX_TIMEOUT_SECONDS = 30 * 86400.0
MAX_DELAY_SECONDS = 366 * 86400.0
SCHEDULED_AT_RANGE = (
    dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc),
    dt.datetime(3000, 1, 1, tzinfo=dt.timezone.utc),
)
DEFAULT_TIMEOUT_SECONDS = 60.0
#: a visibility timeout must exceed the execution timeout by at least this much
VISIBILITY_BUFFER_SECONDS = 5.0
#: when only the timeout is given, the lease is this much longer
DEFAULT_VISIBILITY_MARGIN_SECONDS = 30.0

ENVELOPE_FIELDS = (
    "queue",
    "idempotency_key",
    "dedup_key",
    "lock_key",
    "priority",
    "scheduled_at",
    "delay_seconds",
    "max_attempts",
    "timeout_seconds",
    "visibility_timeout_seconds",
    "retry_policy",
    "tenant_id",
    "trace_id",
)
#: fields the system owns: a producer giving them is an error, never silently trusted
SYSTEM_FIELDS = ("job_id", "id", "attempt", "attempts", "state", "locked_by", "locked_until")
#: the names @task and the CLI give some fields (``@task(timeout=)``, ``--tenant``), and others a producer may
#: reach for, with the envelope field each means
FIELD_ALIASES = {
    "timeout": "timeout_seconds",
    "visibility_timeout": "visibility_timeout_seconds",
    "retry": "retry_policy",
    "delay": "delay_seconds",
    "countdown": "delay_seconds",
    "eta": "scheduled_at",
    "run_at": "scheduled_at",
    "queue_name": "queue",
    "tenant": "tenant_id",
    "trace": "trace_id",
    "attempts_max": "max_attempts",
    "retries": "max_attempts",
    "max_retries": "max_attempts",
    "idempotency": "idempotency_key",
    "dedup": "dedup_key",
    "lock": "lock_key",
}


def _meant(name: Any) -> str:
    """What an unknown field name was meant to be, else the fields there are: ``timeout=5`` was refused as
    "unknown envelope field 'timeout'", and the README lists none of them."""
    text = str(name).strip().lower().replace("-", "_")
    meant = FIELD_ALIASES.get(text) or next((f for f in ENVELOPE_FIELDS if f.startswith(text + "_")), None)
    close = [meant] if meant else difflib.get_close_matches(text, ENVELOPE_FIELDS, n=1, cutoff=0.75)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"the envelope's fields are {', '.join(ENVELOPE_FIELDS)}"


@dataclass(frozen=True)
class Envelope:
    job_type: str
    payload: dict[str, Any]
    payload_json: str
    queue: str
    idempotency_key: str | None
    dedup_key: str | None
    lock_key: str | None
    priority: int
    scheduled_at: dt.datetime | None
    delay_seconds: float
    max_attempts: int
    timeout_seconds: float
    visibility_timeout_seconds: float
    retry_policy: RetryPolicy
    tenant_id: str | None
    trace_id: str | None


@dataclass(frozen=True)
class TypeDefaults:
    """Per-type defaults a producer's local task registry knows (see registry.py)."""

    queue: str = DEFAULT_QUEUE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    visibility_timeout_seconds: float | None = None
    retry_policy: RetryPolicy = DEFAULT_RETRY_POLICY
    requires_idempotency_key: bool = False


def check_payload(problems: list[str], payload: Any) -> str:
    """A payload's problems (appended to ``problems``) and its JSON: an object of string keys, JSON-able
    (no NaN), no NUL, valid text, at most MAX_PAYLOAD_BYTES. Also for a payload an operator's requeue
    replaces (ops.requeue)."""
    payload_json = "{}"
    if not isinstance(payload, Mapping):
        problems.append(f"payload must be a JSON object, not {type(payload).__name__}")
        return payload_json
    try:
        payload_json = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        problems.append(f"payload is not JSON-serialisable: {type(e).__name__}: {e}")
        return "{}"
    shape = _shape(payload)
    if shape.has_bad_key:
        problems.append(f"payload keys must be strings, not {type(shape.bad_key).__name__} {shape.bad_key!r}")
    if shape.depth > MAX_PAYLOAD_DEPTH:
        # json.dumps from a shallow stack takes more; a worker, decoding it deeper in its own, could not
        problems.append(f"payload is nested {shape.depth} levels deep, over the limit of {MAX_PAYLOAD_DEPTH}")
    if NUL_IN_JSON_RE.search(payload_json):
        problems.append("payload must not contain NUL characters")
    if not _utf8(payload_json):
        problems.append("payload must be valid text (it contains a lone surrogate)")
    else:
        size = len(payload_json.encode()) + shape.expansion
        if size > MAX_PAYLOAD_BYTES:
            problems.append(f"payload is {size} bytes as stored, over the limit of {MAX_PAYLOAD_BYTES}")
    return payload_json


def _number(problems: list[str], name: str, value: Any) -> float | None:
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:  # an int beyond any float
        ok = False
    if not ok:
        problems.append(f"{name} must be a finite number, not {_short(value)}")
        return None
    return float(value)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "a huge integer"
    return text if len(text) <= 80 else text[:77] + "..."


def _key(problems: list[str], name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{name} must be a non-empty string")
        return None
    if len(value) > MAX_KEY_LENGTH:
        problems.append(f"{name} is longer than {MAX_KEY_LENGTH} characters")
        return None
    if "\x00" in value or not _utf8(value):
        problems.append(f"{name} must be valid text without NUL characters")
        return None
    return value


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


@dataclass
class _Shape:
    """What json.dumps does not check of a payload (_shape)."""

    bad_key: Any = None
    has_bad_key: bool = False
    depth: int = 0
    #: how much longer PostgreSQL writes the payload's floats than JSON does: jsonb keeps numbers as numeric,
    #: which has no exponent (1e308 comes back as 309 digits, 1e-300 as 302 characters)
    expansion: int = 0


def _shape(value: Any) -> _Shape:
    """Walked without recursion (a payload nested too deeply for recursion must get a clear error).

    Non-string dict keys: json.dumps would silently turn ``{1: "a", "1": "b"}`` into two "1" keys, and
    PostgreSQL keeps only the last."""
    out = _Shape()
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping):
            out.depth = max(out.depth, depth)
            for k, item in v.items():
                if not isinstance(k, str) and not out.has_bad_key:
                    out.bad_key, out.has_bad_key = k, True
                stack.append((item, depth + 1))
        elif isinstance(v, (list, tuple)):
            out.depth = max(out.depth, depth)
            stack.extend((item, depth + 1) for item in v)
        elif isinstance(v, float) and math.isfinite(v) and "e" in repr(v):
            text = repr(v)
            out.expansion += max(0, len(format(decimal.Decimal(text), "f")) - len(text))
    return out


def build_envelope(
    job_type: Any,
    payload: Any,
    fields: Mapping[str, Any],
    defaults: TypeDefaults | None = None,
) -> Envelope:
    """Validate a producer's message and fill in the defaults. Raises EnvelopeError listing every problem."""
    d = defaults or TypeDefaults()
    problems: list[str] = []

    for name in fields:
        if name in SYSTEM_FIELDS:
            problems.append(f"{name} is managed by the system and cannot be given by a producer")
        elif name not in ENVELOPE_FIELDS:
            problems.append(f"unknown envelope field {name!r}: {_meant(name)}")

    if not isinstance(job_type, str) or not job_type:
        problems.append("job_type is required")
        job_type = ""
    elif len(job_type) > MAX_JOB_TYPE_LENGTH or not JOB_TYPE_RE.match(job_type):
        problems.append(f"job_type {job_type!r} must match [a-z0-9_.-]+ (at most {MAX_JOB_TYPE_LENGTH} chars)")

    payload_json = check_payload(problems, payload)
    if not isinstance(payload, Mapping):
        payload = {}

    queue = fields.get("queue", d.queue)
    if not isinstance(queue, str) or not QUEUE_RE.match(queue) or len(queue) > 100:
        problems.append(f"queue {queue!r} must match [A-Za-z0-9_.:-]+")

    idem = _key(problems, "idempotency_key", fields.get("idempotency_key"))
    if idem is not None and TIMESTAMP_IN_KEY_RE.search(idem):
        problems.append("idempotency_key must be stable: it looks like it contains a timestamp")
    if idem is None and d.requires_idempotency_key:
        problems.append(f"job type {job_type!r} has side effects: an idempotency_key is required")
    dedup = _key(problems, "dedup_key", fields.get("dedup_key"))
    lock = _key(problems, "lock_key", fields.get("lock_key"))

    priority = fields.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        problems.append(f"priority must be an integer between -1000 and 1000, not {priority!r}")
        priority = 0

    scheduled_at = fields.get("scheduled_at")
    scheduled_given = scheduled_at is not None  # a bad one too: "not both" is said beside its own problem
    if scheduled_at is not None and (not isinstance(scheduled_at, dt.datetime) or scheduled_at.tzinfo is None):
        problems.append("scheduled_at must be a timezone-aware datetime")
        scheduled_at = None
    elif scheduled_at is not None:
        try:
            utc = scheduled_at.astimezone(dt.timezone.utc)
        except OverflowError:  # year 1 east of UTC, year 9999 west of it
            utc = None
        if utc is None or not SCHEDULED_AT_RANGE[0] <= utc < SCHEDULED_AT_RANGE[1]:
            # out of what every reader decodes: the claim would commit, then fail to read its own batch
            low, high = (d.date().isoformat() for d in SCHEDULED_AT_RANGE)
            problems.append(f"scheduled_at must be between {low} and {high} (UTC), not {scheduled_at.isoformat()}")
            scheduled_at = None
    delay_given = fields.get("delay_seconds", 0.0)
    if isinstance(delay_given, dt.timedelta):  # as TransientError(retry_in=) takes one
        delay_given = delay_given.total_seconds()
    delay = _number(problems, "delay_seconds", delay_given)
    if delay is not None and delay < 0:
        problems.append("delay_seconds must not be negative")
    elif delay is not None and delay > MAX_DELAY_SECONDS:
        problems.append(f"delay_seconds must be at most {MAX_DELAY_SECONDS:g}")
    if scheduled_given and fields.get("delay_seconds"):
        problems.append("give scheduled_at or delay_seconds, not both")

    max_attempts = fields.get("max_attempts", d.max_attempts)
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_MAX_ATTEMPTS
    ):
        problems.append(f"max_attempts must be an integer between 1 and {MAX_MAX_ATTEMPTS}, not {max_attempts!r}")
        max_attempts = 1

    timeout = _number(problems, "timeout_seconds", fields.get("timeout_seconds", d.timeout_seconds))
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        problems.append(f"timeout_seconds must be > 0 and at most {MAX_TIMEOUT_SECONDS:g}")
        timeout = None
    vis_given = fields.get("visibility_timeout_seconds", d.visibility_timeout_seconds)
    visibility: float | None
    if fields.get("visibility_timeout_seconds") is None and fields.get("timeout_seconds") is not None:
        # a timeout given alone: the lease grows with it (the type's, derived from its own timeout, would
        # refuse a longer one), never below the type's
        derived = None if timeout is None else timeout + DEFAULT_VISIBILITY_MARGIN_SECONDS
        default = _number(problems, "visibility_timeout_seconds", vis_given) if vis_given is not None else None
        vis_given = max((v for v in (derived, default) if v is not None), default=None)
    if vis_given is None:
        visibility = None if timeout is None else timeout + DEFAULT_VISIBILITY_MARGIN_SECONDS
    else:
        visibility = _number(problems, "visibility_timeout_seconds", vis_given)
        max_visibility = MAX_TIMEOUT_SECONDS + DEFAULT_VISIBILITY_MARGIN_SECONDS
        if visibility is not None and visibility > max_visibility:
            problems.append(f"visibility_timeout_seconds must be at most {max_visibility:g}")
            visibility = None
        elif visibility is not None and visibility <= 0:
            # said on its own: beside a timeout refused too, the comparison below cannot say it
            problems.append("visibility_timeout_seconds must be > 0")
            visibility = None
    if timeout is not None and visibility is not None and visibility <= timeout + VISIBILITY_BUFFER_SECONDS:
        problems.append(
            f"visibility_timeout_seconds ({visibility:g}) must exceed timeout_seconds ({timeout:g}) "
            f"plus a buffer of {VISIBILITY_BUFFER_SECONDS:g}s"
        )

    policy = d.retry_policy
    raw_policy = fields.get("retry_policy")
    if isinstance(raw_policy, RetryPolicy):
        # the fields it names, over the type's: RetryPolicy(base_seconds=5) keeps the type's backoff
        policy = RetryPolicy(**{**d.retry_policy.to_json(), **raw_policy.overrides()})
    elif isinstance(raw_policy, Mapping):
        # unknown fields said beside the known ones' problems (RetryPolicy.from_json stops at them)
        unknown = sorted(map(str, set(raw_policy) - set(RETRY_FIELDS)))
        if unknown:
            problems.append(f"unknown retry policy fields: {', '.join(unknown)}")
        known = {k: v for k, v in raw_policy.items() if k in RETRY_FIELDS}
        try:
            policy = RetryPolicy.from_json({**d.retry_policy.to_json(), **known})
        except (ValueError, TypeError) as e:
            problems.append(str(e))
    elif raw_policy is not None:
        try:
            policy = RetryPolicy.from_json(raw_policy)
        except (ValueError, TypeError) as e:
            problems.append(str(e))

    tenant_id = _key(problems, "tenant_id", fields.get("tenant_id"))
    trace_id = _key(problems, "trace_id", fields.get("trace_id"))

    if problems:
        raise EnvelopeError(problems)
    assert timeout is not None and visibility is not None and delay is not None
    return Envelope(
        job_type=job_type,
        payload=dict(payload),
        payload_json=payload_json,
        queue=queue,
        idempotency_key=idem,
        dedup_key=dedup,
        lock_key=lock,
        priority=priority,
        scheduled_at=scheduled_at,
        delay_seconds=delay,
        max_attempts=max_attempts,
        timeout_seconds=timeout,
        visibility_timeout_seconds=visibility,
        retry_policy=policy,
        tenant_id=tenant_id,
        trace_id=trace_id,
    )


# --- types for a producer's type checker ------------------------------------------------------------------


class EnvelopeFields(TypedDict, total=False):
    """The envelope fields ``enqueue`` takes as keyword arguments (ENVELOPE_FIELDS), typed as build_envelope
    takes them: for ``**envelope: Unpack[EnvelopeFields]``, a misspelt ``idempotancy_key=`` or a
    ``priority="high"`` is a type checker's error, not only an EnvelopeError at run time. Every one may be
    left out (the type's defaults, the deployment's policy); None is the same as leaving it out."""

    queue: str
    idempotency_key: str | None
    dedup_key: str | None
    lock_key: str | None
    priority: int
    #: timezone-aware; not with delay_seconds
    scheduled_at: dt.datetime | None
    #: seconds, or a timedelta
    delay_seconds: float | dt.timedelta
    max_attempts: int
    timeout_seconds: float
    visibility_timeout_seconds: float | None
    #: the fields it names override the type's: RetryPolicy(base_seconds=5), or {"base_seconds": 5}
    retry_policy: RetryPolicy | Mapping[str, Any] | None
    tenant_id: str | None
    trace_id: str | None
