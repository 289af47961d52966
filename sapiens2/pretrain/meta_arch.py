"""Sapiens2 pretraining meta-architecture: masked pixel reconstruction plus dense and sparse
self-distillation, one function per phase (DINOv3 layout).

L = mae_weight * L_MAE + cl_weight * L_CLS + ibot_weight * L_patch + koleo_weight * L_KoLeo
    (+ position_weight * L_position, the optional position-prediction branch, ``position.py``);
a term with weight 0 is not computed, and the teacher runs only for a distillation term.

- ``teacher.py``: the EMA teacher (``teacher_output``: its targets from the full global crops;
  ``ema_update``).
- ``PretrainStudent.student_output``: the encoder sees the visible tokens only (MAE); the light
  decoder inserts mask tokens and its states at the masked positions feed both the pixel
  predictor and the patch predictor, whose head is matched to the teacher's patch assignment;
  local crops run whole for the CLS term. With ``mae_view='position'`` the decoder reads the
  position branch's pass instead (no positions in the encoder; the decoder places each token)
  and reconstructs the cells that pass left out.
- ``PretrainStudent.losses``: the four terms plus collapse monitors.
Multi-crop and masking are data code (``augment.py``, ``masking.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sapiens2.pretrain import monitors
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.dino import DINOHead, dino_cross_entropy
from sapiens2.pretrain.koleo import koleo_loss
from sapiens2.pretrain.mae import MAEDecoder, mae_loss
from sapiens2.pretrain.position import encode_unplaced, position_logits, position_loss, unseen_cells

LOSS_KEYS = ("loss", "loss_mae", "loss_cl", "loss_ibot", "loss_koleo", "loss_position")
MONITOR_KEYS = ("teacher_entropy", "teacher_marginal_entropy", "agreement", "cls_std")


def _head(in_dim: int, out_dim: int, cfg: ObjectiveConfig) -> DINOHead:
    return DINOHead(in_dim, out_dim, cfg.dino_hidden_dim, cfg.dino_bottleneck_dim)


class PretrainStudent(nn.Module):
    """The trained model: backbone + MAE decoder + CLS head (+ patch predictor and patch head,
    + position head).

    ``forward(global_crops, local_crops, keep_idx, mask_idx, teacher, position_idx)`` takes lists
    with one entry per global crop for ``global_crops`` (B, 3, H, W), ``keep_idx`` (B, N_keep),
    ``mask_idx`` (B, N_mask) and, with the position branch on, ``position_idx`` (B, N_position),
    a (possibly empty) list of local crops, and the ``teacher_output`` dict; it returns the
    ``LOSS_KEYS`` and ``MONITOR_KEYS`` (monitors detached).
    """

    def __init__(self, backbone: nn.Module, cfg: ObjectiveConfig) -> None:
        super().__init__()
        self.backbone = backbone
        dim = backbone.embed_dim
        self.mae_decoder = MAEDecoder(
            dim, cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads,
            backbone.patch_size, backbone.num_prefix_tokens,
        )
        self.dino_head = _head(dim, cfg.dino_out_dim, cfg)
        if cfg.ibot_weight > 0:
            # Maps decoder states into the backbone's token space, where the teacher's copy of
            # the patch head reads its own (unmasked) tokens.
            self.patch_predictor = nn.Linear(cfg.decoder_dim, dim)
            self.ibot_head = _head(dim, cfg.patch_prototypes, cfg)
        if cfg.position_weight > 0:
            grid_height, grid_width = backbone.config.grid_size
            self.position_head = nn.Linear(dim, grid_height * grid_width)
        self.cfg = cfg

    def student_output(
        self, global_crops: Sequence[torch.Tensor], local_crops: Sequence[torch.Tensor],
        keep_idx: Sequence[torch.Tensor], mask_idx: Sequence[torch.Tensor],
        position_idx: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Pixel predictions and patch logits at the masked positions, CLS logits of every crop
        (and the position head's logits for the patches ``position_idx`` names); each only when
        a term with a weight above 0 reads it."""
        cfg = self.cfg
        images = torch.cat(list(global_crops))
        out: dict[str, torch.Tensor | list[torch.Tensor]] = {"images": images, "mask_idx": torch.cat(list(mask_idx))}
        patch = self.backbone.patch_size
        grid = (images.shape[-2] // patch, images.shape[-1] // patch)
        if cfg.position_weight > 0:
            if position_idx is None:
                raise ValueError("position_weight > 0 needs position_idx, one entry per global crop")
            cells = out["position_idx"] = torch.cat(list(position_idx))
            tokens = encode_unplaced(self.backbone, images, cells)
            out["position_logits"] = position_logits(self.backbone, self.position_head, tokens)
            if cfg.mae_weight > 0 and not cfg.mae_on_masked_view:
                # The decoder places each token at its cell; the encoder never saw where they were.
                unseen = out["mae_idx"] = unseen_cells(cells, grid[0] * grid[1])
                out["pixel_pred"] = self.mae_decoder(tokens, cells, unseen, grid)
        if not cfg.uses_masked_view:
            return out
        keep, masked = torch.cat(list(keep_idx)), out["mask_idx"]
        tokens = self.backbone.forward_tokens(images, keep)
        out["global_cls"] = list(tokens[:, 0].chunk(len(global_crops)))
        if cfg.mae_on_masked_view or cfg.ibot_weight > 0:
            states = self.mae_decoder.forward_features(tokens, keep, masked, grid)
            if cfg.mae_on_masked_view:
                out["pixel_pred"], out["mae_idx"] = self.mae_decoder.pred(states), masked
            if cfg.ibot_weight > 0:
                out["patch_logits"] = self.ibot_head(self.patch_predictor(states))
        if cfg.uses_teacher:  # the CLS term, and the agreement monitor beside any distillation
            local = list(local_crops) if cfg.cl_weight > 0 else []  # read by the CLS term only
            cls = [tokens[:, 0]] + ([self.backbone.forward_tokens(torch.cat(local))[:, 0]] if local else [])
            # One head call for all crops keeps a single parameter gather under ZeRO-3.
            views = self.dino_head(torch.cat(cls)).chunk(len(global_crops) + len(local))
            out["global_logits"] = list(views[: len(global_crops)])
            out["local_logits"] = list(views[len(global_crops):])
        return out

    def losses(self, student: dict, teacher: dict | None) -> dict[str, torch.Tensor]:
        """MAE on masked patches; CLS cross-entropy of each global crop against the teacher's
        other global crop and of each local crop against both; patch cross-entropy at the
        masked positions of the same crop; KoLeo on each global crop's student CLS. A term with
        weight 0 is reported as 0; the teacher's monitors come only with a teacher."""
        cfg = self.cfg
        zero = student["images"].new_zeros((), dtype=torch.float32)
        loss_mae = loss_cl = loss_ibot = loss_koleo = loss_position = zero
        if cfg.mae_weight > 0:
            loss_mae = mae_loss(student["pixel_pred"], student["images"], student["mae_idx"], self.backbone.patch_size,
                                cfg.mae_target)
        if cfg.cl_weight > 0:
            probs = teacher["cls_probs"]
            terms = [dino_cross_entropy(logits, p, cfg.student_temp)
                     for i, logits in enumerate(student["global_logits"]) for j, p in enumerate(probs) if i != j]
            terms += [dino_cross_entropy(logits, p, cfg.student_temp)
                      for logits in student["local_logits"] for p in probs]
            loss_cl = torch.stack(terms).mean()
        if cfg.ibot_weight > 0:
            logits = student["patch_logits"]
            loss_ibot = dino_cross_entropy(
                logits.flatten(0, 1), teacher["patch_probs"].flatten(0, 1), cfg.student_temp
            )
        if cfg.koleo_weight > 0:
            loss_koleo = torch.stack([koleo_loss(c) for c in student["global_cls"]]).mean()
        if cfg.position_weight > 0:
            loss_position = position_loss(student["position_logits"], student["position_idx"])
        loss = (cfg.mae_weight * loss_mae + cfg.cl_weight * loss_cl + cfg.ibot_weight * loss_ibot
                + cfg.koleo_weight * loss_koleo + cfg.position_weight * loss_position)
        return {"loss": loss, "loss_mae": loss_mae, "loss_cl": loss_cl, "loss_ibot": loss_ibot,
                "loss_koleo": loss_koleo, "loss_position": loss_position, **self._monitors(student, teacher)}

    @torch.no_grad()
    def _monitors(self, student: dict, teacher: dict | None) -> dict[str, torch.Tensor]:
        """The collapse monitors this step can compute: the teacher's with a teacher, the CLS
        spread with a masked view."""
        watched = {}
        if teacher is not None:
            probs = teacher["cls_probs"]
            teacher_probs = torch.cat(list(probs))
            # Each global crop is judged against the teacher's view of the other crop.
            crossed = torch.cat(list(probs)[::-1])
            watched = {
                "teacher_entropy": monitors.entropy(teacher_probs),
                "teacher_marginal_entropy": monitors.marginal_entropy(teacher_probs),
                "agreement": monitors.agreement(torch.cat(student["global_logits"]).detach(), crossed),
            }
        if "global_cls" in student:
            watched["cls_std"] = monitors.feature_std(torch.cat(student["global_cls"]))
        return watched

    def forward(
        self, global_crops: Sequence[torch.Tensor], local_crops: Sequence[torch.Tensor],
        keep_idx: Sequence[torch.Tensor], mask_idx: Sequence[torch.Tensor], teacher: dict | None,
        position_idx: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``teacher`` is ``teacher_output``'s dict, or None when no distillation term is on."""
        targets = len(teacher["cls_probs"]) if teacher is not None else len(global_crops)
        if not len(global_crops) == len(keep_idx) == len(mask_idx) == targets >= 2:
            raise ValueError(
                "global_crops, keep_idx, mask_idx and teacher cls_probs need one entry per global "
                f"crop (>= 2), got {len(global_crops)}, {len(keep_idx)}, {len(mask_idx)}, {targets}"
            )
        if self.cfg.uses_teacher and teacher is None:
            raise ValueError("cl_weight or ibot_weight > 0 needs the teacher's targets (teacher_output)")
        student = self.student_output(global_crops, local_crops, keep_idx, mask_idx, position_idx)
        return self.losses(student, teacher)
