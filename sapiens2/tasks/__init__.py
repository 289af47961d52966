"""Tasks: per task head wiring, loss, codec/targets, metric and visualisation.

from sapiens2.tasks import TASK_NAMES, get_task, TaskModel, build_task_model
"""

from sapiens2.tasks.base import Metric, Task
from sapiens2.tasks.model import TaskModel, build_task_model, head_scale_for
from sapiens2.tasks.registry import TASK_NAMES, TASKS, get_task

__all__ = [
    "TASKS",
    "TASK_NAMES",
    "Metric",
    "Task",
    "TaskModel",
    "build_task_model",
    "get_task",
    "head_scale_for",
]
