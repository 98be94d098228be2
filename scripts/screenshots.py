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
#: file name -> (terminal size, keys pressed after start, break the database first)
SHOTS: dict[str, tuple[tuple[int, int], Sequence[str], bool]] = {
    "overview": (WIDE, (), False),
    "overview-80x24": (NARROW, (), False),
    "jobs": (WIDE, ("j",), False),
    "job-detail": (WIDE, ("j", "enter"), False),
    "dead-letters": (WIDE, ("d", "space"), False),
    "dead-letters-80x24": (NARROW, ("d",), False),
    "confirm-requeue": (WIDE, ("d", "space", "space", "r"), False),
    "charts": (WIDE, ("c",), False),
    "workers": (WIDE, ("w",), False),
    "audit": (WIDE, ("a",), False),
    "job-types": (WIDE, ("t", "down"), False),
    "help": (WIDE, ("question_mark",), False),
    "outage": (WIDE, (), True),
}


async def shoot(name: str, size: tuple[int, int], keys: Sequence[str], outage: bool, out: Path) -> Path:
    backend = FakeBackend()
    app = fake_app(backend)
    async with app.run_test(size=size) as pilot:

        async def settle() -> None:
            for _ in range(2):
                await app.workers.wait_for_complete()
                await pilot.pause()

        await settle()
        if outage:
            backend.fail_reads = True
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
    for name, (size, keys, outage) in SHOTS.items():
        path = await shoot(name, size, keys, outage, out)
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "screenshots")
    asyncio.run(main(parser.parse_args().out.resolve()))
