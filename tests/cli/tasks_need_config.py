"""A task module that reads its configuration at import (``qconsole worker --tasks tests.cli.tasks_need_config``):
without it set, importing it raises a KeyError, not an ImportError."""

from __future__ import annotations

import os

import worker_core

SETTINGS_URL = os.environ["TASKS_NEED_CONFIG_SETTINGS_URL"]


@worker_core.task("t.needs_config")
def needs_config(ctx: object, payload: dict[str, object]) -> None:
    pass
