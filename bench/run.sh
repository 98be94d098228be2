#!/usr/bin/env sh
# `make bench`: create bench/.venv (once), install the project and the peers, run bench/run.py.
#   bench/run.sh            full run (~8 min on 2 cores)
#   bench/run.sh --quick    development run (~2-3 min)
# The server: $QCONSOLE_BENCH_DSN (default postgresql://postgres@127.0.0.1:5432/postgres); when it is
# unreachable, the embedded server (worker_core.embedded) is used and the table says so.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
VENV="$HERE/.venv"
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.installed"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$HERE/requirements.txt" -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade "pip>=24"
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT" -r "$HERE/requirements.txt"
    touch "$STAMP"
fi
cd "$ROOT"
exec "$VENV/bin/python" "$HERE/run.py" "$@"
