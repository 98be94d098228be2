"""Named SQL blocks from queries.sql, loaded once: ``queries["claim"]``.

A block named ``fragment_<x>`` is not a query but a piece that others include as ``{{x}}`` (the claims
share their UPDATE and the columns they return). Fragments are expanded at load time, so every query
is still one fixed string.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import cast

from typing_extensions import LiteralString

_NAME_RE = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_INCLUDE_RE = re.compile(r"\{\{([a-z_][a-z0-9_]*)\}\}")
FRAGMENT = "fragment_"


def parse(text: str) -> dict[str, LiteralString]:
    """The named queries of a queries.sql text, fragments expanded."""
    parts = _NAME_RE.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=False):
        lines = [ln for ln in body.strip().splitlines() if not ln.startswith("-----")]
        if name in blocks:
            raise RuntimeError(f"duplicate query name {name!r} in queries.sql")
        blocks[name] = "\n".join(lines).strip().rstrip(";")

    def expand(match: re.Match[str]) -> str:
        fragment = blocks.get(FRAGMENT + match.group(1))
        if fragment is None:
            raise RuntimeError(f"queries.sql includes an unknown fragment {match.group(1)!r}")
        code = "\n".join(ln for ln in fragment.splitlines() if not ln.lstrip().startswith("--"))
        return _INCLUDE_RE.sub(expand, code)

    return {
        name: cast(LiteralString, _INCLUDE_RE.sub(expand, body))
        for name, body in blocks.items()
        if not name.startswith(FRAGMENT)
    }


queries: dict[str, LiteralString] = parse(
    resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
)
