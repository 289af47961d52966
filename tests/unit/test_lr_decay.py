"""Layer-wise lr decay groups on a small named model shaped like backbone + head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sapiens2.train.lr_decay import layerwise_param_groups

DEPTH = 3


class TinyBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.patch_embed = nn.Conv2d(3, 8, 4, 4)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(8)


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = TinyBackbone()
        self.head = nn.Linear(8, 2)


def layer_id(name: str) -> int:
    if name.startswith(("cls_token", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return DEPTH + 1


def _by_name(model: nn.Module, groups: list[dict]) -> dict[str, dict]:
    owner = {id(p): g for g in groups for p in g["params"]}
    return {name: owner[id(p)] for name, p in model.named_parameters()}


def test_scales_follow_depth_and_head_gets_one() -> None:
    model = TinyModel()
    groups = layerwise_param_groups(model, base_lr=1e-3, weight_decay=0.1, layer_decay=0.5,
                                    num_layers=DEPTH, layer_id_fn=layer_id)
    scale = {name: g["lr_scale"] for name, g in _by_name(model, groups).items()}
    r = 0.5
    assert scale["backbone.cls_token"] == scale["backbone.patch_embed.weight"] == r ** (DEPTH + 1)
    for i in range(DEPTH):
        assert scale[f"backbone.blocks.{i}.weight"] == scale[f"backbone.blocks.{i}.bias"] == r ** (DEPTH - i)
    assert scale["backbone.norm.weight"] == 1.0
    assert scale["head.weight"] == scale["head.bias"] == 1.0
    for g in groups:
        assert g["lr"] == pytest.approx(1e-3 * g["lr_scale"])


def test_head_lr_scale_multiplies_only_the_parameters_outside_the_backbone() -> None:
    model = TinyModel()
    plain = _by_name(model, layerwise_param_groups(model, 1e-3, 0.1, 0.5, DEPTH, layer_id))
    scaled = _by_name(model, layerwise_param_groups(model, 1e-3, 0.1, 0.5, DEPTH, layer_id, head_lr_scale=5.0))
    for name in plain:
        expected = 5.0 * plain[name]["lr_scale"] if name.startswith("head.") else plain[name]["lr_scale"]
        assert scaled[name]["lr_scale"] == pytest.approx(expected), name
        assert scaled[name]["lr"] == pytest.approx(1e-3 * expected), name


def test_biases_and_1d_params_get_no_weight_decay() -> None:
    model = TinyModel()
    groups = layerwise_param_groups(model, 1e-3, 0.1, 0.9, DEPTH, layer_id)
    decay = {name: g["weight_decay"] for name, g in _by_name(model, groups).items()}
    assert decay["backbone.norm.weight"] == decay["backbone.blocks.1.bias"] == decay["head.bias"] == 0.0
    assert decay["backbone.patch_embed.weight"] == decay["backbone.blocks.1.weight"] == decay["head.weight"] == 0.1
    assert decay["backbone.cls_token"] == 0.1  # 3-D token: not a bias, not 1-D


def test_every_trainable_param_in_exactly_one_group_and_frozen_ones_left_out() -> None:
    model = TinyModel()
    model.backbone.blocks[0].requires_grad_(False)
    groups = layerwise_param_groups(model, 1e-3, 0.1, 0.8, DEPTH, layer_id)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters() if p.requires_grad}
    assert len({(g["lr_scale"], g["weight_decay"]) for g in groups}) == len(groups)


def test_no_decay_rate_one_gives_uniform_scale_and_prefix_is_respected() -> None:
    model = TinyModel()
    groups = layerwise_param_groups(model, 1e-3, 0.1, 1.0, DEPTH, layer_id)
    assert {g["lr_scale"] for g in groups} == {1.0}
    # With a prefix matching nothing, everything counts as "outside the backbone".
    groups = layerwise_param_groups(model, 1e-3, 0.1, 0.5, DEPTH, layer_id, backbone_prefix="encoder.")
    assert {g["lr_scale"] for g in groups} == {1.0}


def test_out_of_range_layer_id_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="backbone.cls_token"):
        layerwise_param_groups(TinyModel(), 1e-3, 0.1, 0.5, DEPTH, lambda name: -1)


def test_real_backbone_layer_ids() -> None:
    from sapiens2.model import build_backbone

    model = nn.Module()
    model.backbone = build_backbone("sapiens2_debug", img_size=(32, 32))
    model.head = nn.Linear(model.backbone.embed_dim, 2)
    depth = model.backbone.depth
    groups = layerwise_param_groups(model, 1e-3, 0.1, 0.8, depth, model.backbone.layer_id)
    scale = {name: g["lr_scale"] for name, g in _by_name(model, groups).items()}
    assert scale["backbone.cls_token"] == scale["backbone.patch_embed.projection.weight"] == 0.8 ** (depth + 1)
    assert scale[f"backbone.blocks.{depth - 1}.attn.wq.weight"] == 0.8
    assert scale["backbone.ln1.weight"] == scale["head.weight"] == 1.0
