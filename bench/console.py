"""Scenario 7 (the process side): the console's time to first frame and its resident memory.

The console is launched as an operator would get it, in a pseudo-terminal of 80x24 (``TERM=xterm-256color``):
``python -c`` builds the app through ``qconsole.app.run_console`` (else ``make_app`` over a
``DatabaseBackend``) on the 1M-row database. The bench reads the terminal's output:

- first frame: the first time the overview screen's title ("Overview") is drawn;
- first data: the first time a job type of the table (``invoice.generate``) is drawn;
- resident memory: RSS of the console's process tree 4 s after the first data (two refreshes), and its
  peak (VmHWM).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import psutil

from bench.harness import child_env, log

LAUNCH = r"""
import sys
dsn = sys.argv[1]
try:
    from qconsole.app import run_console
except ImportError:
    run_console = None
if run_console is not None:
    sys.exit(run_console(dsn, False, 2.0, None))
from qconsole.app import make_app
from qconsole.backend import DatabaseBackend
backend = DatabaseBackend(dsn)
sys.exit(make_app(backend, clock=backend.clock, refresh_seconds=2.0).run() or 0)
"""

PROBE = "import qconsole.app, qconsole.backend"
ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[PX^_][^\x1b]*\x1b\\|\x1b[@-Z\\-_]")
FIRST_FRAME = b"Overview"
FIRST_DATA = b"invoice.generate"


def importable() -> str | None:
    """None if the console imports, else why not."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=child_env(), capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


def _tree_rss(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process and its children, in bytes."""
    rss = peak = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            rss += p.memory_info().rss
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1]) * 1024
    return rss, peak


def measure(dsn: str, logdir: Path, timeout: float = 30.0) -> dict[str, Any]:
    why = importable()
    if why is not None:
        log(f"  console: skipped, qconsole.app does not import ({why})")
        return {"skipped": f"qconsole.app does not import: {why}"}
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = child_env({"TERM": "xterm-256color", "COLORTERM": "truecolor"})
    for var in ("COLUMNS", "LINES", "TEXTUAL", "TEXTUAL_DRIVER"):
        env.pop(var, None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, dsn],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    os.close(slave)
    raw = bytearray()
    first_frame = first_data = None
    result: dict[str, Any] = {}
    try:
        deadline = t0 + timeout
        while time.perf_counter() < deadline and first_data is None:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                raw += chunk
                text = ANSI.sub(b"", bytes(raw))
                now = time.perf_counter()
                if first_frame is None and FIRST_FRAME in text:
                    first_frame = now - t0
                if first_data is None and FIRST_DATA in text:
                    first_data = now - t0
            if proc.poll() is not None:
                break
        if first_data is not None:
            # two refreshes later: the steady state an operator leaves open during an incident
            settle = time.perf_counter() + 4.0
            while time.perf_counter() < settle:
                ready, _, _ = select.select([master], [], [], 0.1)
                if ready:
                    with contextlib.suppress(OSError):
                        raw += os.read(master, 65536)
            rss, peak = _tree_rss(proc.pid)
            result.update({"rss_mb": rss / 2**20, "peak_rss_mb": peak / 2**20})
        with contextlib.suppress(OSError):
            os.write(master, b"q")
        try:
            proc.wait(8)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    finally:
        with contextlib.suppress(OSError):
            while select.select([master], [], [], 0)[0]:
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                raw += chunk
        os.close(master)
        (logdir / "console-pty.log").write_bytes(bytes(raw[-200_000:]))
    result.update({"first_frame_s": first_frame, "first_data_s": first_data, "exit_code": proc.returncode})
    if first_frame is None:
        result["problem"] = f"no frame within {timeout:.0f}s (see {logdir / 'console-pty.log'})"
    log(
        "  console: first frame "
        + (f"{first_frame:.2f}s" if first_frame is not None else "never")
        + ", first data "
        + (f"{first_data:.2f}s" if first_data is not None else "never")
        + (f", RSS {result['rss_mb']:.0f} MB (peak {result['peak_rss_mb']:.0f} MB)" if "rss_mb" in result else "")
    )
    return result
