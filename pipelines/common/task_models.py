"""The model a fine-tune starts from (which evaluation rebuilds for its untrained-head baseline)
and the optimizer groups it trains with."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipelines.common.config import PlatformConfig
from sapiens2.model import build_backbone, load_checkpoint
from sapiens2.tasks import TaskModel, build_task_model
from sapiens2.train.config import FinetuneOptimSection
from sapiens2.train.lr_decay import layerwise_param_groups

# `backbone_init` of a from-scratch control: the backbone starts from its seeded random init.
SCRATCH = "scratch"


def backbone_weights(config: PlatformConfig, backbone_dir: Path) -> Path:
    """The backbone fine-tuning starts from: a published checkpoint if configured, else ours."""
    if config.finetune.init_checkpoint:
        return Path(config.finetune.init_checkpoint)
    return backbone_dir / "backbone.safetensors"


def initial_model(config: PlatformConfig, task: str, backbone_path: Path | str) -> TaskModel:
    """Backbone weights from `backbone_path` (or, for `SCRATCH`, the seeded random init the
    pretraining run started from) plus a freshly initialised head (seeded): the model fine-tuning
    starts from, and the untrained-head baseline evaluation compares against."""
    torch.manual_seed(config.pretrain.seed)
    backbone = build_backbone(config.pretrain.arch, img_size=config.image_size)
    if str(backbone_path) != SCRATCH:
        load_checkpoint(backbone, Path(backbone_path))
    torch.manual_seed(config.finetune.seed)
    return build_task_model(task, backbone, **config.task_settings(task))


def finetune_param_groups(model: TaskModel, optim: FinetuneOptimSection, steps: int) -> list[dict]:
    """AdamW groups of a `steps`-step fine-tune: layer-wise lr decay over the backbone, the head
    at `head_lr_scale`, and the backbone frozen for its `backbone_frozen_fraction` of the run."""
    frozen = optim.backbone_frozen_steps(steps)
    return layerwise_param_groups(
        model, optim.lr, optim.weight_decay, optim.layer_decay, model.backbone.depth, model.backbone.layer_id,
        frozen_steps=lambda name: frozen if name.startswith("backbone.") else 0, head_lr_scale=optim.head_lr_scale,
    )


def record_backbone(backbone_path: Path | str, model_dir: Path) -> str:
    """`backbone_init` as `model.json` stores it: relative to the model folder, so the folder's
    bytes (its DVC md5) do not depend on where the workspace lives or who ran the step."""
    if str(backbone_path) == SCRATCH:
        return SCRATCH
    return os.path.relpath(Path(backbone_path).resolve(), Path(model_dir).resolve())


def recorded_backbone(spec: dict, model_dir: Path) -> Path | str:
    """The backbone a saved model started from (`SCRATCH` or a path), as `record_backbone` wrote it."""
    init = spec["backbone_init"]
    return SCRATCH if init == SCRATCH else Path(model_dir) / init
