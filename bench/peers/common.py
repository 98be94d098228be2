"""What every system's handlers share: where the pickup-latency probe writes, and the effects table."""

from __future__ import annotations

import os
import time

#: set by the bench for the pickup-latency scenario: each handler appends "<i> <time.time()>" here
PICKUP_FILE_ENV = "QCBENCH_PICKUP_FILE"

#: the idempotent-write scenario's business table (one row per job; the key makes a replay a no-op)
EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS bench_effects (
    key        text PRIMARY KEY,
    item       integer NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
)
"""
EFFECT_INSERT = "INSERT INTO bench_effects (key, item) VALUES (%s, %s)"
EFFECT_INSERT_PEER = "INSERT INTO bench_effects (key, item) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING"
EFFECT_INSERT_ASYNCPG = "INSERT INTO bench_effects (key, item) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING"


def record_pickup(i: int) -> None:
    """Called first thing in a handler: when did it start, for job ``i``?"""
    now = time.time()
    path = os.environ.get(PICKUP_FILE_ENV)
    if path:
        with open(path, "a", encoding="ascii") as f:
            f.write(f"{i} {now:.6f}\n")
