"""Typed training config sections: the single source of truth the DeepSpeed JSON is generated from.

Defaults follow the Sapiens2 fine-tuning recipe (AdamW lr 5e-4, betas (0.9, 0.999), weight decay
0.1, 500 warmup iterations, linear decay to 0, grad clip in 2-4, bf16).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from sapiens2.config_section import ConfigSection


class DeepSpeedSection(ConfigSection):
    """How a step is parallelised: ZeRO stage, precision, batch split and gradient clipping."""

    zero_stage: Literal[1, 2, 3] = 2
    bf16: bool = True
    micro_batch_size: int = Field(1, ge=1, description="samples per rank per forward pass")
    grad_accum_steps: int = Field(1, ge=1, description="micro batches per optimizer step")
    grad_clip: float = Field(3.0, gt=0, description="max global gradient L2 norm")
    world_size: int = Field(1, ge=1, description="data-parallel ranks the run is launched with")

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by one optimizer step across all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size


class OptimSection(ConfigSection):
    """AdamW hyper-parameters and the per-step learning-rate schedule shape."""

    lr: float = Field(5e-4, gt=0, description="peak learning rate (after warmup)")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(500, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of lr")
    layer_decay: float = Field(1.0, gt=0, le=1, description="layer-wise lr decay rate; 1 = off")
    schedule: Literal["linear", "cosine"] = "linear"

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must lie in [0, 1), got {betas}")
        return betas


class FinetuneOptimSection(OptimSection):
    """Fine-tuning's AdamW section: also the task head's learning-rate multiplier."""

    head_lr_scale: float = Field(
        1.0, gt=0, description="lr multiplier of the parameters outside the backbone (the freshly initialised task head)"
    )
    # LP-FT: the fresh head first fits features the backbone already has, so its early, large and
    # random gradients do not overwrite them. A fraction of the run, as each task trains its own steps.
    backbone_frozen_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of the first fine-tuning steps in which the backbone's lr is 0"
    )

    def backbone_frozen_steps(self, steps: int) -> int:
        """Optimizer steps of a `steps`-step run during which the backbone stays frozen."""
        return round(self.backbone_frozen_fraction * steps)


class CheckpointSection(ConfigSection):
    """How often to checkpoint and how many checkpoints to keep on disk."""

    every_n_steps: int = Field(1000, ge=1)
    keep_last: int = Field(2, ge=1)
