"""Sapiens2 pretraining meta-architecture: L = L_MAE + lambda * L_CL, one function per phase.

Phases of a step (DINOv3 layout): ``teacher_output`` (EMA teacher on the full global crops ->
centred, sharpened prototype probabilities), ``PretrainStudent.student_output`` (masked global
crops through the encoder on visible tokens only, local crops in full), ``PretrainStudent.losses``
(MAE on the masked patches, DINO cross-entropy of student CLS against the teacher), and
``ema_update``. Multi-crop and masking are data code (``augment.py``, ``masking.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.dino import DINOHead, TeacherCenter, dino_cross_entropy
from sapiens2.pretrain.mae import MAEDecoder, mae_loss

# Largest number of ZeRO-3 partitioned elements gathered at once during the EMA update.
_EMA_GATHER_NUMEL = 1 << 26


class PretrainStudent(nn.Module):
    """The trained model: backbone + light MAE decoder + DINO head.

    ``forward(global_crops, local_crops, keep_idx, mask_idx, teacher_probs)`` takes lists with one
    entry per global crop for ``global_crops`` (B, 3, H, W), ``keep_idx`` (B, N_keep),
    ``mask_idx`` (B, N_mask) and ``teacher_probs`` (B, K), plus a (possibly empty) list of local
    crops, and returns ``dict(loss, loss_mae, loss_cl)``.
    """

    def __init__(self, backbone: nn.Module, cfg: ObjectiveConfig) -> None:
        super().__init__()
        self.backbone = backbone
        self.mae_decoder = MAEDecoder(
            backbone.embed_dim,
            cfg.decoder_dim,
            cfg.decoder_depth,
            cfg.decoder_heads,
            backbone.patch_size,
            backbone.num_prefix_tokens,
        )
        self.dino_head = DINOHead(
            backbone.embed_dim, cfg.dino_out_dim, cfg.dino_hidden_dim, cfg.dino_bottleneck_dim
        )
        self.cl_weight = cfg.cl_weight
        self.student_temp = cfg.student_temp

    def student_output(
        self,
        global_crops: Sequence[torch.Tensor],
        local_crops: Sequence[torch.Tensor],
        keep_idx: Sequence[torch.Tensor],
        mask_idx: Sequence[torch.Tensor],
    ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """MAE predictions of the masked global patches and DINO logits of every crop's CLS."""
        images = torch.cat(list(global_crops))
        keep, masked = torch.cat(list(keep_idx)), torch.cat(list(mask_idx))
        tokens = self.backbone.forward_tokens(images, keep)
        patch = self.backbone.patch_size
        grid = (images.shape[-2] // patch, images.shape[-1] // patch)
        pixel_pred = self.mae_decoder(tokens, keep, masked, grid)
        cls = [tokens[:, 0]]
        if local_crops:
            cls.append(self.backbone.forward_tokens(torch.cat(list(local_crops)))[:, 0])
        # One head call for all crops keeps a single parameter gather under ZeRO-3.
        logits = self.dino_head(torch.cat(cls))
        n_global, n_local = len(global_crops), len(local_crops)
        views = logits.chunk(n_global + n_local)
        return {
            "images": images,
            "mask_idx": masked,
            "pixel_pred": pixel_pred,
            "global_logits": list(views[:n_global]),
            "local_logits": list(views[n_global:]),
        }

    def losses(
        self,
        student: dict[str, torch.Tensor | list[torch.Tensor]],
        teacher_probs: Sequence[torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """MAE loss on masked patches; DINO loss of each global crop against the teacher's other
        global crop and of each local crop against both teacher global crops."""
        loss_mae = mae_loss(
            student["pixel_pred"], student["images"], student["mask_idx"], self.backbone.patch_size
        )
        terms = [
            dino_cross_entropy(logits, probs, self.student_temp)
            for i, logits in enumerate(student["global_logits"])
            for j, probs in enumerate(teacher_probs)
            if i != j
        ]
        terms += [
            dino_cross_entropy(logits, probs, self.student_temp)
            for logits in student["local_logits"]
            for probs in teacher_probs
        ]
        loss_cl = torch.stack(terms).mean()
        loss = loss_mae + self.cl_weight * loss_cl
        return {"loss": loss, "loss_mae": loss_mae, "loss_cl": loss_cl}

    def forward(
        self,
        global_crops: Sequence[torch.Tensor],
        local_crops: Sequence[torch.Tensor],
        keep_idx: Sequence[torch.Tensor],
        mask_idx: Sequence[torch.Tensor],
        teacher_probs: Sequence[torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        if not len(global_crops) == len(keep_idx) == len(mask_idx) == len(teacher_probs) >= 2:
            raise ValueError(
                "global_crops, keep_idx, mask_idx and teacher_probs need one entry per global "
                f"crop (>= 2), got {len(global_crops)}, {len(keep_idx)}, {len(mask_idx)}, "
                f"{len(teacher_probs)}"
            )
        student = self.student_output(global_crops, local_crops, keep_idx, mask_idx)
        return self.losses(student, teacher_probs)


class TeacherModel(nn.Module):
    """EMA teacher: a frozen copy of the student's backbone and DINO head; ``forward`` -> logits."""

    def __init__(self, backbone: nn.Module, dino_head: DINOHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.dino_head = dino_head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.dino_head(self.backbone.forward_tokens(images)[:, 0])


def build_teacher(student: PretrainStudent) -> TeacherModel:
    """Deep copy of the student's backbone and DINO head, frozen and in eval mode.

    Call before DeepSpeed wraps the student: a ZeRO-3 partitioned parameter holds only its shard.
    """
    if any(hasattr(p, "ds_id") for p in student.parameters()):
        raise RuntimeError("build_teacher needs the unpartitioned student; call it before ZeRO-3")
    teacher = TeacherModel(copy.deepcopy(student.backbone), copy.deepcopy(student.dino_head))
    teacher.requires_grad_(False)
    return teacher.eval()


@torch.no_grad()
def teacher_output(
    teacher: TeacherModel,
    global_crops: Sequence[torch.Tensor],
    center: TeacherCenter,
    temp: float,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Teacher probabilities per global crop, softmax((logits - center) / temp), and the batch's
    mean logits (to pass to ``center.update`` after the step).

    Crops are cast to the teacher's parameter dtype: the teacher stays fp32 while a bf16 engine
    feeds bf16 crops to the student.
    """
    dtype = next(teacher.parameters()).dtype
    logits = teacher(torch.cat(list(global_crops)).to(dtype)).float()
    probs = torch.softmax((logits - center.center) / temp, dim=-1)
    return list(probs.chunk(len(global_crops))), logits.mean(dim=0)


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
        torch._foreach_lerp_(targets, [s.detach().to(t.dtype) for t, s in plain], weight)
    partitioned = [(t, s) for t, s in pairs if hasattr(s, "ds_id")]
    if partitioned:
        import deepspeed  # only needed, and only importable cheaply, when ZeRO-3 is in use

        for chunk in _chunk_by_numel(partitioned, _EMA_GATHER_NUMEL):
            with deepspeed.zero.GatheredParameters([s for _, s in chunk], modifier_rank=None):
                for t, s in chunk:
                    t.lerp_(s.detach().to(t.dtype), weight)


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
