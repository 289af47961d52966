"""Pretraining as the `Trainer` runs it: the student engine, the EMA teacher and the centre
together, one method per phase (DINOv3's meta-architecture layout).

- `loss`: draw a batch -> multi-crop + masks -> teacher targets -> student forward (losses and
  collapse monitors, `PretrainStudent`);
- `after_step`: the teacher follows the student (EMA), the centre absorbs the step's batches;
- `state_dict`: teacher and centre, so a resumed run continues with the same targets.

The teacher and the centre move to the engine's device once, here; the teacher's crops and its
targets are made on that device, so nothing crosses between CPU and accelerator inside a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sapiens2.pretrain.augment import MultiCropAugment
from sapiens2.pretrain.centering import Centering
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.masking import MaskGenerator, mask_to_indices
from sapiens2.pretrain.teacher import TeacherModel, ema_update, teacher_output
from sapiens2.pretrain.position import draw_position_idx, unseen_cells
from sapiens2.pretrain.schedules import objective_schedules
from sapiens2.train.engine import autocast_inputs


def build_centering(obj: ObjectiveConfig) -> Centering:
    return Centering(obj.centering, obj.dino_out_dim, obj.patch_prototypes if obj.ibot_weight > 0 else None,
                     obj.center_momentum, obj.sinkhorn_iterations)


class PretrainRecipe:
    """MAE + dense and sparse self-distillation on `images` (N, H, W, 3 uint8) for `total_steps`.

    `teacher` is `build_teacher(student)` made before DeepSpeed wrapped the student (under ZeRO-3
    the engine's parameters hold only shards).
    """

    def __init__(self, engine: Any, teacher: TeacherModel, obj: ObjectiveConfig, images: np.ndarray,
                 image_size: tuple[int, int], micro_batch_size: int, total_steps: int) -> None:
        self.engine, self.obj, self.images, self.batch = engine, obj, images, micro_batch_size
        self.teacher = teacher.to(engine.device)
        self.centering = build_centering(obj).to(engine.device)
        self.schedules = objective_schedules(obj, total_steps)
        height, width = image_size
        self.augment = MultiCropAugment(global_size=(height, width), local_size=(height // 2, width // 2),
                                        n_local=obj.n_local)
        patch = engine.module.backbone.patch_size
        self.masker = MaskGenerator((height // patch, width // patch), obj.mask_ratio, obj.block_prob)
        self.num_tokens = (height // patch) * (width // patch)

    def loss(self, step: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        idx = torch.randint(len(self.images), (self.batch,), generator=generator)
        crops = self.augment(self.images[idx.numpy()], generator)
        masks = [mask_to_indices(self.masker(self.batch, generator)) for _ in crops["global_crops"]]
        device = self.engine.device
        keep = [k.to(device) for k, _ in masks]
        masked = [m.to(device) for _, m in masks]
        # The teacher (fp32) sees the full-precision crops; a bf16 engine gets its own cast.
        global_crops = [c.to(device) for c in crops["global_crops"]]
        targets = None  # the teacher runs only for a distillation term: it is a third of a step
        if self.obj.uses_teacher:
            targets = teacher_output(self.teacher, global_crops, masked, self.centering,
                                     float(self.schedules["teacher_temp"][step]))
        # Drawn only when the branch is on, so runs without it keep their random stream.
        cells = None
        if self.obj.position_weight > 0:
            cells = [draw_position_idx(self.batch, self.num_tokens, self.obj.position_keep_ratio, generator).to(device)
                     for _ in global_crops]
        return self.engine([autocast_inputs(self.engine, c) for c in global_crops],
                           [autocast_inputs(self.engine, c) for c in crops["local_crops"]], keep, masked, targets,
                           cells)

    def reconstruction_view(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The cells the MAE decoder reads and reconstructs on ``batch`` images, and whether the
        encoder sees positions: the masked view, or the position branch's (``mae_view``)."""
        if self.obj.mae_view == "position":
            cells = draw_position_idx(batch, self.num_tokens, self.obj.position_keep_ratio, generator)
            return cells, unseen_cells(cells, self.num_tokens), False
        return (*mask_to_indices(self.masker(batch, generator)), True)

    def after_step(self, step: int) -> dict[str, float]:
        momentum = float(self.schedules["ema_momentum"][step])
        ema_update(self.teacher, self.engine.module, momentum)
        self.centering.update()
        return {"ema_momentum": momentum, "teacher_temp": float(self.schedules["teacher_temp"][step])}

    def state_dict(self) -> dict[str, Any]:
        return {"teacher": self.teacher.state_dict(), "centering": self.centering.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teacher.load_state_dict(state["teacher"])
        self.centering.load_state_dict(state["centering"])

