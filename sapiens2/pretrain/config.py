"""Typed configuration of the Sapiens2 pretraining objective (MAE + dense and CLS self-distillation)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sapiens2.config_section import ConfigSection

# What the MAE reconstruction is scored against (`mae_loss`'s `target`).
MaeTarget = Literal["normalized", "pixels"]


class ObjectiveConfig(ConfigSection):
    """Hyper-parameters of L = mae_weight * L_MAE + cl_weight * L_CLS + ibot_weight * L_patch
    + koleo_weight * L_KoLeo (+ position_weight * L_position, an option the paper does not have).

    A term with weight 0 costs nothing: the EMA teacher runs only for a distillation term
    (``uses_teacher``), the masked view and its decoder only for a term that reads them, so a
    position-only run trains at the speed of that branch alone.

    Defaults follow the paper (mask ratio 0.75, blockwise probability 0.4) and DINOv2/DINOv3 for
    the distillation branch (student temperature 0.1, teacher warmed up from 0.04 to 0.07,
    Sinkhorn-Knopp centring with 3 iterations, KoLeo 0.1, iBOT patch loss 1.0).

    Schedules are fractions of the run, so a 150-step demo and a 500k-step run get the same shape:
    the teacher temperature warms up over ``teacher_temp_warmup_fraction`` of the steps, the last
    layer of both heads stays frozen for ``freeze_last_layer_fraction``, and the teacher EMA starts
    with a time constant of ``ema_time_constant_fraction`` of the run (never slower than
    ``ema_momentum_start``, DINO's long-run value) and rises to ``ema_momentum_end`` on a cosine.
    A fixed 0.994 start on a 150-step run leaves the teacher at its initial weights.
    """

    mask_ratio: float = Field(0.75, gt=0.0, lt=1.0)
    block_prob: float = Field(0.4, ge=0.0, le=1.0)
    mae_weight: float = Field(1.0, ge=0.0, description="weight of the masked pixel reconstruction loss")
    cl_weight: float = Field(1.0, ge=0.0, description="lambda, weight of the CLS (sparse) distillation loss")
    ibot_weight: float = Field(1.0, ge=0.0, description="weight of the masked-patch (dense) distillation loss")
    koleo_weight: float = Field(0.1, ge=0.0, description="weight of the KoLeo spread regulariser on the student CLS")
    n_local: int = Field(2, ge=0, description="local crops per image")
    position_weight: float = Field(
        0.0, ge=0.0, description="weight of the masked position-prediction loss (0 = off; sapiens2.pretrain.position)"
    )
    position_keep_ratio: float = Field(0.5, gt=0.0, le=1.0, description="share of patches the position branch sees")
    mae_target: MaeTarget = Field(
        "normalized", description="MAE targets: each patch normalised to zero mean and unit variance (MAE's "
        "norm_pix_loss), or the (dataset-normalised) input pixels, keeping patch brightness and contrast",
    )
    mae_view: Literal["masked", "position"] = Field(
        "masked", description="the encoder pass the MAE decoder reads: the masked view (the paper's), or the "
        "position branch's pass, reconstructing the patches it did not see (one encoder pass for both terms)",
    )

    dino_out_dim: int = Field(65536, ge=2, description="number of CLS prototypes")
    ibot_out_dim: int | None = Field(None, ge=2, description="number of patch prototypes (default: dino_out_dim)")
    dino_hidden_dim: int = Field(2048, ge=1)
    dino_bottleneck_dim: int = Field(256, ge=1)
    student_temp: float = Field(0.1, gt=0.0)
    teacher_temp: float = Field(0.07, gt=0.0, description="teacher temperature after warmup")
    teacher_temp_warmup_start: float = Field(0.04, gt=0.0)
    teacher_temp_warmup_fraction: float = Field(0.3, ge=0.0, le=1.0)
    centering: Literal["sinkhorn_knopp", "ema"] = "sinkhorn_knopp"
    sinkhorn_iterations: int = Field(3, ge=1)
    center_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="EMA centring only")
    ema_momentum_start: float = Field(0.994, ge=0.0, le=1.0)
    ema_momentum_end: float = Field(1.0, ge=0.0, le=1.0)
    ema_time_constant_fraction: float = Field(0.05, gt=0.0, le=1.0)
    freeze_last_layer_fraction: float = Field(0.05, ge=0.0, le=1.0)

    decoder_dim: int = Field(256, ge=1)
    decoder_depth: int = Field(2, ge=1)
    decoder_heads: int = Field(8, ge=1)

    @property
    def patch_prototypes(self) -> int:
        return self.ibot_out_dim or self.dino_out_dim

    @property
    def uses_teacher(self) -> bool:
        """A self-distillation term is on, so each step needs the EMA teacher's targets."""
        return self.cl_weight > 0 or self.ibot_weight > 0

    @property
    def mae_on_masked_view(self) -> bool:
        """The MAE term is on and its decoder reads the masked view (not the position branch's pass)."""
        return self.mae_weight > 0 and self.mae_view == "masked"

    @property
    def uses_masked_view(self) -> bool:
        """A term reads the student's masked view of the global crops (its decoder or its CLS)."""
        return self.mae_on_masked_view or self.uses_teacher or self.koleo_weight > 0

    @model_validator(mode="after")
    def _check_consistency(self) -> ObjectiveConfig:
        if not (self.uses_masked_view or self.position_weight > 0):
            raise ValueError("mae_weight, cl_weight, ibot_weight, koleo_weight and position_weight are all 0: "
                             "the objective has nothing to train")
        if self.mae_view == "position" and not (self.mae_weight > 0 and self.position_weight > 0):
            raise ValueError(f"mae_view 'position' reads the position branch's pass: it needs mae_weight "
                             f"({self.mae_weight}) and position_weight ({self.position_weight}) above 0")
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
