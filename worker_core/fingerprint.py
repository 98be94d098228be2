"""Error fingerprints: an error message with numbers, ids and quoted values normalized away, so the
dead letters of one cause group together ("Timeout after 31s for order 'ord_9'" and "... 12s ... 'ord_3'"
are one group)."""

from __future__ import annotations

import re

_SUBS = [
    (re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"), "<uuid>"),
    (re.compile(r"'[^']*'"), "'<*>'"),
    (re.compile(r'"[^"]*"'), '"<*>"'),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    (re.compile(r"\b[0-9a-fA-F]{16,}\b"), "<hex>"),
    (re.compile(r"\b[A-Za-z]+_[A-Za-z0-9]*\d[A-Za-z0-9]*\b"), "<id>"),
    (re.compile(r"\d+(\.\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
]
MAX_LEN = 300


def fingerprint(error_class: str, message: str) -> str:
    text = message.strip().splitlines()[0] if message.strip() else ""
    for pattern, repl in _SUBS:
        text = pattern.sub(repl, text)
    return f"{error_class}: {text}"[:MAX_LEN]
