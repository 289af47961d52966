"""The task table: name -> task class, and `get_task` to instantiate one with its settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from sapiens2.labels import TASK_NAMES
from sapiens2.tasks.albedo import AlbedoTask
from sapiens2.tasks.base import Task
from sapiens2.tasks.normal import NormalTask
from sapiens2.tasks.pointmap import PointmapTask
from sapiens2.tasks.pose import PoseTask
from sapiens2.tasks.seg import SegTask

TASKS: dict[str, type[Task]] = {
    "pose": PoseTask,
    "seg": SegTask,
    "normal": NormalTask,
    "pointmap": PointmapTask,
    "albedo": AlbedoTask,
}
if tuple(TASKS) != TASK_NAMES:
    raise ImportError(f"sapiens2.tasks.registry: tasks {tuple(TASKS)} differ from the label spaces' {TASK_NAMES}")


def get_task(name: str, **settings: Any) -> Task:
    """The task called `name`, with any of its dataclass fields overridden.

    Example: get_task("pose", sigma=6.0) for the reference 256x192 heatmaps.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {TASK_NAMES}")
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(settings) - fields
    if unknown:
        raise ValueError(
            f"task {name!r} has no setting(s) {sorted(unknown)}; settings: {sorted(fields)}"
        )
    return cls(**settings)
