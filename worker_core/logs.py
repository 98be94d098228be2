"""Structured logs: every line about a job carries job_id, job_type, queue, attempt, trace_id and, where
set, idempotency_key. ``--log-format json`` for machines, plain key=value for people."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

JOB_FIELDS = (
    "worker_id",
    "job_id",
    "job_type",
    "queue",
    "attempt",
    "trace_id",
    "tenant_id",
    "idempotency_key",
)
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JobLogger(logging.LoggerAdapter):
    """A logger bound to fields; per-call ``extra`` adds to them."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = {k: v for k, v in extra.items() if v is not None}
        return msg, kwargs

    def bind(self, **fields: Any) -> JobLogger:
        return JobLogger(self.logger, {**(self.extra or {}), **fields})


def bound_logger(name: str = "worker_core", **fields: Any) -> JobLogger:
    return JobLogger(logging.getLogger(name), fields)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    #: its times are UTC, as the Z it writes says (they were the host's local time, labelled Z)
    converter = time.gmtime  # type: ignore[assignment]  # typeshed reads its optional argument as required

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


#: what a text log line never carries raw: line breaks, and control characters (ESC's terminal sequences)
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escaped(text: str) -> str:
    """One line of printable text: a message or a field a producer or a handler wrote (a trace_id, an
    error) forged log lines with its newlines and drove the operator's terminal with its escapes."""
    return _UNPRINTABLE.sub(lambda m: {"\n": "\\n", "\t": "\\t"}.get(m[0], f"\\x{ord(m[0]):02x}"), text)


def _value(v: Any) -> str:
    text = _escaped(str(v))
    if text and not any(c in text for c in ' ="'):
        return text
    return '"' + text.replace('"', '\\"') + '"'  # one value, however many words


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {_escaped(record.getMessage())}"
        fields = _fields(record)
        if fields:
            base += "  " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        if record.exc_info:  # a traceback's lines stay lines; its characters are escaped as the rest
            base += "\n" + "\n".join(_escaped(line) for line in self.formatException(record.exc_info).splitlines())
        return base


def setup_logging(fmt: str = "text", level: str | int = "INFO", stream: Any = None) -> None:
    """Configure the root handler once: ``fmt`` is "json" or "text"."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_worker_core", False):
            root.removeHandler(h)
    handler._worker_core = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())


def job_fields(job: Mapping[str, Any] | Any) -> dict[str, Any]:
    get = job.get if isinstance(job, Mapping) else lambda k: getattr(job, k, None)
    return {
        "job_id": str(get("id")),
        "job_type": get("job_type"),
        "queue": get("queue"),
        "attempt": get("attempts"),
        "trace_id": get("trace_id"),
        "tenant_id": get("tenant_id"),
        "idempotency_key": get("idempotency_key"),
    }
