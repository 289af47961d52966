"""Fine-tuning one task as the `Trainer` runs it: sample a labelled batch, predict, the task's loss.

Nothing lives outside the engine (no teacher, no centre), so there is no extra state to resume;
the dataset's augmentation is re-seeded per step (`set_epoch`), so batches are a pure function
of (seed, step, rank).
"""

from __future__ import annotations

from typing import Any

import torch

from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.tasks.base import Task
from sapiens2.train.engine import autocast_inputs


def _to_float(pred: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """Losses run in fp32 whatever precision the engine computes in."""
    if isinstance(pred, dict):
        return {k: v.float() for k, v in pred.items()}
    return pred.float()


class FinetuneRecipe:
    """`task`'s loss on micro-batches of `micro_batch_size` drawn with replacement from `data`."""

    def __init__(self, engine: Any, task: Task, data: CuratedDataset, micro_batch_size: int) -> None:
        self.engine, self.task, self.data, self.batch = engine, task, data, micro_batch_size

    def loss(self, step: int, generator: torch.Generator) -> dict[str, torch.Tensor | float]:
        self.data.set_epoch(step)
        picks = torch.randint(len(self.data), (self.batch,), generator=generator)
        batch = collate([self.data[int(i)] for i in picks])
        pred = _to_float(self.engine(autocast_inputs(self.engine, batch["image"])))
        loss, parts = self.task.loss(pred, batch)
        return {**parts, "loss": loss}

    def after_step(self, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
