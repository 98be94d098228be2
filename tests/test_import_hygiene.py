"""The dependency runs one way: qconsole -> worker_core -> psycopg. worker_core never reaches the UI or
the CLI, and the CLI's non-console commands never pay for importing Textual."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import worker_core

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("textual", "textual_plotext", "plotext", "typer", "qconsole")


def loaded_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_worker_core_never_imports_the_ui_or_the_cli() -> None:
    modules = [m.name for m in pkgutil.walk_packages(worker_core.__path__, "worker_core.")]
    assert "worker_core.worker" in modules and "worker_core.stats" in modules
    loaded = loaded_after("\n".join(f"import {m}" for m in modules))
    leaked = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert leaked == []


def test_the_cli_loads_textual_only_for_the_console() -> None:
    loaded = loaded_after("import qconsole.cli")
    assert "typer" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("textual", "plotext", "textual_plotext")]
