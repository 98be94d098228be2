"""A task module that cannot be imported in a --processes child (a library that fails there): the supervisor,
which imported it fine, sees its children die before their first heartbeat, again and again."""

from __future__ import annotations

import multiprocessing

import tests.worker_core.tasks  # noqa: F401

if multiprocessing.parent_process() is not None:
    raise RuntimeError("this module cannot be imported in a worker process")
