"""Layer-wise learning-rate decay and weight-decay exemption as optimizer parameter groups."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def layerwise_param_groups(
    model: nn.Module,
    base_lr: float,
    weight_decay: float,
    layer_decay: float,
    num_layers: int,
    layer_id_fn: Callable[[str], int],
    backbone_prefix: str = "backbone.",
    frozen_steps: Callable[[str], int] | None = None,
    head_lr_scale: float = 1.0,
    no_weight_decay: Callable[[str], bool] | None = None,
) -> list[dict]:
    """Split the trainable parameters of `model` into AdamW groups.

    Parameters under `backbone_prefix` get lr scale `layer_decay ** (num_layers + 1 - layer_id)`,
    where `layer_id_fn(name_without_prefix)` returns 0 for the embeddings (patch embedding, CLS and
    storage tokens), i + 1 for block i and num_layers + 1 for the final norm. So embeddings get
    rate^(L+1), block i rate^(L-i) and the final norm 1; parameters outside the backbone (task
    heads, decoders) get `head_lr_scale`. 1-D parameters (norms, LayerScale), biases and the
    parameters `no_weight_decay(name)` names (DINO's prototypes) get no weight decay.

    Each group carries `lr` (= base_lr * lr_scale), `lr_scale`, `weight_decay` and
    `frozen_until` (the training loop rescales `lr` from `lr_scale` every step and sets it to 0
    before step `frozen_until`). `frozen_steps(name)` gives a parameter's frozen steps (DINO's
    last layer, a fine-tune's backbone); a frozen parameter keeps its weight decay for the steps
    after it thaws (at lr 0 AdamW's decoupled decay is 0 too).
    """
    groups: dict[tuple[float, float, int], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        scale = head_lr_scale
        if name.startswith(backbone_prefix):
            layer_id = layer_id_fn(name[len(backbone_prefix):])
            if not 0 <= layer_id <= num_layers + 1:
                raise ValueError(f"layer_id_fn gave {layer_id} for {name!r}; expected 0..{num_layers + 1}")
            scale = layer_decay ** (num_layers + 1 - layer_id)
        frozen = frozen_steps(name) if frozen_steps else 0
        exempt = param.ndim <= 1 or name.endswith(".bias") or (no_weight_decay is not None and no_weight_decay(name))
        decay = 0.0 if exempt else weight_decay
        group = groups.setdefault(
            (scale, decay, frozen),
            {"params": [], "lr": base_lr * scale, "lr_scale": scale, "weight_decay": decay, "frozen_until": frozen},
        )
        group["params"].append(param)
    return list(groups.values())


def apply_lr(param_groups: list[dict], lr: float, step: int | None = None) -> None:
    """Set each group's lr to `lr * group['lr_scale']`, or to 0 while the group is still frozen at
    `step` (before its `frozen_until`); call before each optimizer step."""
    for group in param_groups:
        frozen = step is not None and step < group.get("frozen_until", 0)
        group["lr"] = 0.0 if frozen else lr * group["lr_scale"]
