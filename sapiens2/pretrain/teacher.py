"""The EMA teacher of self-distillation: a frozen copy of the student's backbone and heads, its
targets for the student's crops, and the update that makes it follow the student.

- ``build_teacher``: the copy, made before DeepSpeed wraps (and ZeRO-3 partitions) the student;
- ``teacher_output``: CLS and masked-patch targets from the full global crops (Sinkhorn-Knopp or
  EMA centring), run only when a distillation term is on;
- ``ema_update``: teacher <- EMA of the student, gathering ZeRO-3 shards in bounded chunks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from sapiens2.pretrain.centering import Centering
from sapiens2.pretrain.dino import DINOHead

if TYPE_CHECKING:
    from sapiens2.pretrain.meta_arch import PretrainStudent

# Largest number of ZeRO-3 partitioned elements gathered at once during the EMA update.
_EMA_GATHER_NUMEL = 1 << 26


class TeacherModel(nn.Module):
    """EMA teacher: a frozen copy of the student's backbone and heads.

    ``forward(images, mask_idx)`` -> (CLS logits (B, K), patch logits at ``mask_idx``
    (B, N_mask, K_patch) or None without a patch head).
    """

    def __init__(self, backbone: nn.Module, dino_head: DINOHead, ibot_head: DINOHead | None) -> None:
        super().__init__()
        self.backbone = backbone
        self.dino_head = dino_head
        self.ibot_head = ibot_head

    def forward(self, images: torch.Tensor, mask_idx: torch.Tensor | None = None):
        tokens = self.backbone.forward_tokens(images)
        cls_logits = self.dino_head(tokens[:, 0])
        if self.ibot_head is None or mask_idx is None:
            return cls_logits, None
        patches = tokens[:, self.backbone.num_prefix_tokens:]
        picked = patches.gather(1, mask_idx[..., None].expand(-1, -1, patches.shape[-1]))
        return cls_logits, self.ibot_head(picked)


def build_teacher(student: PretrainStudent) -> TeacherModel:
    """Deep copy of the student's backbone and heads, frozen and in eval mode.

    Call before DeepSpeed wraps the student (a ZeRO-3 partitioned parameter holds only its
    shard), then move it to the engine's device once (``teacher.to(engine.device)``).
    """
    if any(hasattr(p, "ds_id") for p in student.parameters()):
        raise RuntimeError("build_teacher needs the unpartitioned student; call it before ZeRO-3")
    ibot = copy.deepcopy(student.ibot_head) if hasattr(student, "ibot_head") else None
    teacher = TeacherModel(copy.deepcopy(student.backbone), copy.deepcopy(student.dino_head), ibot)
    teacher.requires_grad_(False)
    return teacher.eval()


@torch.no_grad()
def teacher_output(
    teacher: TeacherModel,
    global_crops: Sequence[torch.Tensor],
    mask_idx: Sequence[torch.Tensor],
    centering: Centering,
    temp: float,
) -> dict[str, list[torch.Tensor] | torch.Tensor | None]:
    """Targets per global crop: ``cls_probs`` (list of (B, K)) and ``patch_probs``
    (2B, N_mask, K_patch) at the student's masked positions (None without a patch head).

    Crops move to the teacher's device and dtype: the teacher stays fp32 while a bf16 engine
    feeds bf16 crops to the student.
    """
    param = next(teacher.parameters())
    images = torch.cat(list(global_crops)).to(param.device, param.dtype)
    masked = torch.cat(list(mask_idx)).to(param.device)
    cls_logits, patch_logits = teacher(images, masked)
    cls_probs = centering.targets(cls_logits.float(), temp, "cls")
    patch_probs = None
    if patch_logits is not None:
        flat = centering.targets(patch_logits.float().flatten(0, 1), temp, "patch")
        patch_probs = flat.reshape(patch_logits.shape)
    return {"cls_probs": list(cls_probs.chunk(len(global_crops))), "patch_probs": patch_probs}


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """teacher <- momentum * teacher + (1 - momentum) * student, matching parameters by name.

    ``student`` is the plain module (``engine.module`` under DeepSpeed). ZeRO-3 partitioned
    student parameters (those with ``ds_id``) are gathered in bounded chunks to read them.
    """
    student_params = dict(student.named_parameters())
    pairs = []
    for name, t_param in teacher.named_parameters():
        if name not in student_params:
            raise KeyError(f"teacher parameter {name!r} has no student counterpart")
        pairs.append((t_param, student_params[name]))
    weight = 1.0 - momentum
    plain = [(t, s) for t, s in pairs if not hasattr(s, "ds_id")]
    if plain:
        targets = [t for t, _ in plain]
        torch._foreach_lerp_(targets, [s.detach().to(t.device, t.dtype) for t, s in plain], weight)
    partitioned = [(t, s) for t, s in pairs if hasattr(s, "ds_id")]
    if partitioned:
        import deepspeed  # only needed, and only importable cheaply, when ZeRO-3 is in use

        for chunk in _chunk_by_numel(partitioned, _EMA_GATHER_NUMEL):
            with deepspeed.zero.GatheredParameters([s for _, s in chunk], modifier_rank=None):
                for t, s in chunk:
                    t.lerp_(s.detach().to(t.device, t.dtype), weight)


def _chunk_by_numel(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], max_numel: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    size = 0
    for t, s in pairs:
        if chunks[-1] and size + t.numel() > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append((t, s))
        size += t.numel()
    return chunks
