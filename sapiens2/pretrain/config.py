"""Typed configuration of the Sapiens2 pretraining objective (MAE + CLS self-distillation)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ObjectiveConfig(BaseModel):
    """Hyper-parameters of L = L_MAE + cl_weight * L_CL.

    Defaults follow the paper (mask ratio 0.75, blockwise probability 0.4) and the DINO recipe for
    the distillation branch (student temperature 0.1, teacher warmed up from 0.04 to 0.07,
    EMA centre momentum 0.9, teacher EMA momentum ramped from 0.994 to 1 by a cosine).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mask_ratio: float = Field(0.75, gt=0.0, lt=1.0)
    block_prob: float = Field(0.4, ge=0.0, le=1.0)
    cl_weight: float = Field(1.0, ge=0.0, description="lambda, weight of the contrastive loss")
    n_local: int = Field(2, ge=0, description="local crops per image")

    dino_out_dim: int = Field(65536, ge=2, description="number of prototypes")
    dino_hidden_dim: int = Field(2048, ge=1)
    dino_bottleneck_dim: int = Field(256, ge=1)
    student_temp: float = Field(0.1, gt=0.0)
    teacher_temp: float = Field(0.07, gt=0.0, description="teacher temperature after warmup")
    teacher_temp_warmup_start: float = Field(0.04, gt=0.0)
    teacher_temp_warmup_steps: int = Field(0, ge=0)
    center_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    ema_momentum_start: float = Field(0.994, ge=0.0, le=1.0)
    ema_momentum_end: float = Field(1.0, ge=0.0, le=1.0)

    decoder_dim: int = Field(256, ge=1)
    decoder_depth: int = Field(2, ge=1)
    decoder_heads: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check_consistency(self) -> ObjectiveConfig:
        if self.decoder_dim % self.decoder_heads:
            raise ValueError(
                f"decoder_dim ({self.decoder_dim}) must be divisible by decoder_heads "
                f"({self.decoder_heads})"
            )
        if self.decoder_dim % 4:
            # The 2D sin-cos position embedding splits the width into 4 equal parts.
            raise ValueError(f"decoder_dim ({self.decoder_dim}) must be divisible by 4")
        if self.ema_momentum_start > self.ema_momentum_end:
            raise ValueError(
                f"ema_momentum_start ({self.ema_momentum_start}) must not exceed "
                f"ema_momentum_end ({self.ema_momentum_end})"
            )
        return self
