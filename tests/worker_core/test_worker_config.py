"""WorkerConfig refuses at construction what would make a worker do something else than asked."""

from __future__ import annotations

import pytest

from worker_core.worker import WorkerConfig

# --------------------------------------------------------------------- WorkerConfig, refused at construction


def test_task_modules_or_queues_given_as_a_str_are_refused_saying_what_to_write() -> None:
    # "myapp.tasks" was imported letter by letter (No module named 'm'); "billing" worked queues b, i, l...
    with pytest.raises(TypeError, match=r"""task_modules=\('myapp.tasks',\)"""):
        WorkerConfig(task_modules="myapp.tasks")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"""queues=\('billing',\)"""):
        WorkerConfig(queues="billing")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a module name"):
        WorkerConfig(task_modules=("myapp.tasks", ""))
    with pytest.raises(ValueError, match="not a queue name"):
        WorkerConfig(queues=("billing", "bad queue"))
    taken = WorkerConfig(task_modules=["a.tasks"], queues=["billing"])  # type: ignore[arg-type]
    assert (taken.task_modules, taken.queues) == (("a.tasks",), ("billing",))
    assert WorkerConfig().queues is None



@pytest.mark.parametrize("interval", [0, -1, float("nan")])
def test_a_heartbeat_interval_that_is_no_interval_is_refused(interval: float) -> None:
    # 0 beat without pause, a negative one too (Event.wait returns at once)
    with pytest.raises(ValueError, match="more than 0"):
        WorkerConfig(heartbeat_interval=interval)
    assert WorkerConfig(heartbeat_interval=10).heartbeat_interval == 10
