"""Write an SVG of every console screen into screenshots/, over the fake backend of the tests (fixed data,
ids and clock), at 120x36 (and the overview at 80x24 too).

    python scripts/screenshots.py [--out screenshots]

These are the README's pictures, not the test baselines (tests/qconsole/__snapshots__/).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.qconsole.conftest import FakeBackend, fake_app  # noqa: E402

WIDE = (120, 36)
NARROW = (80, 24)
#: file name -> (terminal size, keys pressed after start, break the database first: "outage" (unreachable) or
#: "refused" (it answers every read with an error), or nothing)
SHOTS: dict[str, tuple[tuple[int, int], Sequence[str], str]] = {
    "overview": (WIDE, (), ""),
    "overview-80x24": (NARROW, (), ""),
    "jobs": (WIDE, ("j",), ""),
    "job-detail": (WIDE, ("j", "enter"), ""),
    "dead-letters": (WIDE, ("d", "space"), ""),
    "dead-letters-80x24": (NARROW, ("d",), ""),
    "confirm-requeue": (WIDE, ("d", "space", "space", "r"), ""),
    "charts": (WIDE, ("c",), ""),
    "workers": (WIDE, ("w",), ""),
    "audit": (WIDE, ("a",), ""),
    "job-types": (WIDE, ("t", "down"), ""),
    "help": (WIDE, ("question_mark",), ""),
    "limit-form": (WIDE, ("down", "down", "down", "l"), ""),
    "payload-fix": (WIDE, ("j", "enter", "E"), ""),
    "outage": (WIDE, (), "outage"),
    "reads-failing": (WIDE, (), "refused"),
}


async def shoot(name: str, size: tuple[int, int], keys: Sequence[str], broken: str, out: Path) -> Path:
    backend = FakeBackend()
    app = fake_app(backend)
    async with app.run_test(size=size) as pilot:

        async def settle() -> None:
            for _ in range(2):
                await app.workers.wait_for_complete()
                await pilot.pause()

        await settle()
        if broken:
            backend.fail_reads = broken == "outage"
            backend.refuse_reads = broken == "refused"
            app.clock.advance(42)  # type: ignore[attr-defined]
            await pilot.press("ctrl+r")
            await settle()
        for key in keys:
            await pilot.press(key)
            await settle()
        path = out / f"{name}.svg"
        app.save_screenshot(filename=path.name, path=str(out))
    return path


async def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (size, keys, broken) in SHOTS.items():
        path = await shoot(name, size, keys, broken, out)
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "screenshots")
    asyncio.run(main(parser.parse_args().out.resolve()))
