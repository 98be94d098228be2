"""Named SQL blocks from queries.sql, loaded once: ``queries["claim"]``."""

from __future__ import annotations

import re
from importlib import resources
from typing import cast

from typing_extensions import LiteralString

_NAME_RE = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def _load() -> dict[str, LiteralString]:
    text = resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    parts = _NAME_RE.split(text)
    out: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=False):
        lines = [ln for ln in body.strip().splitlines() if not ln.startswith("-----")]
        query = "\n".join(lines).strip().rstrip(";")
        if name in out:
            raise RuntimeError(f"duplicate query name {name!r} in queries.sql")
        out[name] = cast(LiteralString, query)
    return out


queries: dict[str, LiteralString] = _load()
