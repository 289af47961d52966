"""A backbone plus a task head as one module, and the factory that sizes the head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sapiens2.tasks.registry import get_task

# Below this width a backbone is one of the small test/demo configs (tiny D=128, debug D=64);
# the reference sizes start at 0.1b's 768.
TINY_HEAD_BELOW_EMBED_DIM = 512


def head_scale_for(embed_dim: int) -> str:
    return "tiny" if embed_dim < TINY_HEAD_BELOW_EMBED_DIM else "reference"


class TaskModel(nn.Module):
    """`head(backbone(images))`: images (B, 3, H, W) normalised -> the task's prediction."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor) -> Any:
        features = self.backbone(images)
        if getattr(self.head, "takes_image", False):
            return self.head(features, images)
        return self.head(features)


def build_task_model(
    task_name: str, backbone: nn.Module, scale: str | None = None, **settings: Any
) -> TaskModel:
    """TaskModel with the head of `task_name` sized from `backbone.embed_dim`.

    scale defaults to "tiny" for embed_dim < 512, else "reference"; settings go to get_task.
    """
    task = get_task(task_name, **settings)
    embed_dim = int(backbone.embed_dim)
    return TaskModel(backbone, task.build_head(embed_dim, scale or head_scale_for(embed_dim)))
