"""What ``pgq run bench.peers.pgqueuer_app:factory --batch-size N --mode drain`` does, without its CLI.

pgqueuer 1.6's ``pgq run`` fails at start-up with the typer release this project pins
(``logconfig.setup_fancy_logger`` gets a str, not a LogLevel), so the bench calls the same supervisor
(``pgqueuer.run``) on the same event loop (uvloop) itself.
"""

from __future__ import annotations

import argparse
import logging
from datetime import timedelta

import pgqueuer
from pgqueuer.adapters.cli.cli import asyncio_run
from pgqueuer.domain.types import QueueExecutionMode

from bench.peers.pgqueuer_app import factory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--mode", choices=[m.name for m in QueueExecutionMode], default="drain")
    parser.add_argument("--max-concurrent-tasks", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio_run(
        pgqueuer.run(
            factory,
            batch_size=args.batch_size,
            mode=QueueExecutionMode[args.mode],
            max_concurrent_tasks=args.max_concurrent_tasks,
            dequeue_timeout=timedelta(seconds=30),
        )
    )


if __name__ == "__main__":
    main()
