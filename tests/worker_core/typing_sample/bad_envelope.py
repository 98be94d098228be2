"""Envelope mistakes ``mypy --strict`` catches in a producer, each marked on its line with ``# expect: CODE``,
once ``enqueue`` takes ``**envelope: Unpack[EnvelopeFields]`` (tests/worker_core/test_typing.py)."""

from __future__ import annotations

from typing import Any

import psycopg

import worker_core


def produce(conn: psycopg.Connection[Any]) -> None:
    worker_core.enqueue(conn, "sample.mail.send", {}, idempotancy_key="mail:1")  # expect: call-arg
    worker_core.enqueue(conn, "sample.mail.send", {}, timeout=5)  # expect: call-arg
    worker_core.enqueue(conn, "sample.mail.send", {}, priority="high")  # expect: arg-type
    worker_core.enqueue(conn, "sample.mail.send", {}, delay_seconds="90s")  # expect: arg-type
