"""worker_core is typed for its users (PEP 561): ``mypy --strict`` on an application checks its handlers and
producers against the library's signatures, rather than reporting ``import-untyped`` and ``untyped-decorator``
(found by an integrator's review: tests/review_integrator, commit 4e59e1c).

mypy runs as a user's would: on the sample files copied to a directory of their own, with worker_core found
as the installed package (``pip install -e .``), never as source next to them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import typing
from collections import defaultdict
from pathlib import Path

import pytest

import worker_core
from worker_core.envelope import ENVELOPE_FIELDS, EnvelopeFields

pytestmark = pytest.mark.xdist_group("mypy_strict")  # one mypy run per test session, not one per xdist worker

SAMPLE = Path(__file__).with_name("typing_sample")
ERROR_RE = re.compile(r"^(?P<file>[\w.]+\.py):(?P<line>\d+): error: (?P<message>.*)  \[(?P<code>[\w-]+)\]$")
EXPECT_RE = re.compile(r"#\s*expect:\s*(?P<code>[a-z][a-z-]+)$")

#: (line, code) of each error mypy gave, by file name
Found = dict[str, set[tuple[int, str]]]


@pytest.fixture(scope="module")
def mypy_strict(tmp_path_factory: pytest.TempPathFactory) -> tuple[Found, str]:
    here = tmp_path_factory.mktemp("typing_sample")
    for path in SAMPLE.glob("*.py"):
        shutil.copy(path, here / path.name)
    files = sorted(p.name for p in here.glob("*.py"))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(here / ".mypy_cache"), "--config-file", "",
         "--show-error-codes", "--no-color-output", "--no-error-summary", *files],
        cwd=here, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    found: Found = defaultdict(set)
    for line in out.stdout.splitlines():
        m = ERROR_RE.match(line)
        if m:
            found[m["file"]].add((int(m["line"]), m["code"]))
    return found, out.stdout + out.stderr


def expected(name: str) -> set[tuple[int, str]]:
    lines = (SAMPLE / name).read_text().splitlines()
    return {(i, m["code"]) for i, text in enumerate(lines, 1) if (m := EXPECT_RE.search(text))}


def test_worker_core_ships_a_py_typed_marker() -> None:
    """The review's finding: without it, ``mypy --strict`` on an application reports ``import-untyped`` for
    ``import worker_core`` and ``untyped-decorator`` on every handler, and checks none of the library's
    signatures. (hatchling puts every file of the package in the wheel: ``pip wheel`` lists it.)"""
    assert (Path(worker_core.__file__).parent / "py.typed").is_file()


def test_mypy_strict_passes_an_application_written_as_the_readme_shows(mypy_strict: tuple[Found, str]) -> None:
    found, output = mypy_strict
    assert not found["good_app.py"], output


def test_mypy_strict_flags_the_handlers_and_fields_an_application_gets_wrong(mypy_strict: tuple[Found, str]) -> None:
    """A handler that cannot take (ctx, payload), a sync context's ``ctx.tx`` awaited, a row used without
    its None case, a misspelt or mistyped envelope field: each is flagged, and nothing else is."""
    found, output = mypy_strict
    want = expected("bad_app.py")
    assert len(want) >= 8
    assert found["bad_app.py"] == want, output


def test_mypy_strict_flags_a_misspelt_envelope_keyword_of_enqueue(mypy_strict: tuple[Found, str]) -> None:
    found, output = mypy_strict
    want = expected("bad_envelope.py")
    assert len(want) == 4
    assert found["bad_envelope.py"] == want, output


def test_envelope_fields_types_every_envelope_field_and_no_other() -> None:
    assert EnvelopeFields.__required_keys__ == frozenset()
    assert set(EnvelopeFields.__optional_keys__) == set(ENVELOPE_FIELDS)


def test_the_contexts_are_usable_at_run_time_too() -> None:
    """``JobContext`` stays a plain class (isinstance, construction); ``AsyncJobContext`` is the same class
    with its ``tx`` typed for async handlers, usable in annotations evaluated at run time."""
    assert typing.get_origin(worker_core.AsyncJobContext) is worker_core.JobContext
    hints = typing.get_type_hints(worker_core.JobContext)
    assert "_tx" in hints

    def handler(ctx: worker_core.AsyncJobContext, payload: dict[str, object]) -> None: ...

    assert typing.get_type_hints(handler)["ctx"] == worker_core.AsyncJobContext
