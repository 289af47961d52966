"""Importing published checkpoints: written here in the reference layout, from the listing's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipelines.cli import main as cli
from sapiens2.model import (
    CheckpointMismatchError,
    build_backbone,
    import_checkpoint,
    infer_arch,
    load_checkpoint,
    load_pretrained,
)

LISTING = Path(__file__).resolve().parents[3] / "shared" / "reference" / "official_backbone_state_dicts.json"
# sapiens2_debug: D 64, 2 heads of 32, depth 4; blocks 1 and 2 have one key/value head (GQA).
DEBUG_GQA_BLOCKS = {1, 2}
DEBUG_DIMS = {1536: 64, 12288: 512, 6144: 256, 768: 32, 64: 32, 16: 8}  # 1b width -> debug width


@pytest.fixture(scope="module")
def reference() -> dict:
    assert LISTING.is_file(), f"reference listing not found at {LISTING}"
    return json.loads(LISTING.read_text())


def debug_layout(reference: dict, local_blocks: int) -> dict[str, list[int]]:
    """The ``sapiens2_1b_4k`` listing cut down to sapiens2_debug(_4k): the listing's block 0
    (full attention) and block 8 (GQA) name/shape templates per debug block, its local block 0
    per tokenizer block, and 1b widths replaced by debug widths. No code under test involved."""
    source = reference["sapiens2_1b_4k"]["state_dict"]
    layout = {}
    for name, shape in source.items():
        if name == "patch_embed.projection.weight":  # (D, 3, 16, 16): the patch stays 16 px
            layout[name] = [DEBUG_DIMS[shape[0]], *shape[1:]]
            continue
        scaled = [DEBUG_DIMS.get(s, s) for s in shape]
        if name.startswith("tokenizer.blocks."):
            if name.startswith("tokenizer.blocks.0."):
                for i in range(local_blocks):
                    layout[name.replace(".0.", f".{i}.", 1)] = scaled
        elif name.startswith("tokenizer."):
            if local_blocks:
                layout[name] = scaled
        elif name.startswith("blocks."):
            template = int(name.split(".")[1])
            for i in range(4):
                if template == (8 if i in DEBUG_GQA_BLOCKS else 0):
                    layout[name.replace(f"blocks.{template}.", f"blocks.{i}.", 1)] = scaled
        else:
            layout[name] = scaled
    return layout


def reference_state(layout: dict[str, list[int]], dtype: torch.dtype, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    state = {name: (torch.randn(shape, generator=generator) * 0.05).to(dtype) for name, shape in layout.items()}
    head_dim = 2 * 2 * len(state["rope_embed.periods"])  # RoPE periods are real, positive values
    state["rope_embed.periods"] = 100.0 ** (torch.arange(0, head_dim // 2, 2) / (head_dim // 2))
    return state


def test_every_listing_size_is_recognised(reference):
    """Every name and shape of every published size maps onto our module (meta tensors only)."""
    for arch, entry in reference.items():
        state = {k: torch.empty(s, device="meta") for k, s in entry["state_dict"].items()}
        assert infer_arch(state) == arch


@pytest.mark.parametrize(
    ("arch", "suffix", "wrap", "dtype"),
    [
        ("sapiens2_debug", ".safetensors", lambda sd: sd, torch.bfloat16),
        ("sapiens2_debug_4k", ".pth", lambda sd: {"teacher": {"backbone." + k: v for k, v in sd.items()}},
         torch.float32),
        ("sapiens2_debug", ".bin", lambda sd: {"state_dict": {"module." + k: v for k, v in sd.items()}, "iter": 9},
         torch.float32),
    ],
)
def test_cli_imports_reference_layout_checkpoint(tmp_path, reference, capsys, arch, suffix, wrap, dtype):
    state = reference_state(debug_layout(reference, 2 if arch.endswith("_4k") else 0), dtype)
    source = tmp_path / f"published{suffix}"
    if suffix == ".safetensors":
        save_file(wrap(state), str(source))
    else:
        torch.save(wrap(state), source)
    output = tmp_path / "imported" / "backbone.safetensors"

    assert cli(["import-checkpoint", str(source), "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert f"arch        {arch} (inferred from names and shapes)" in printed
    assert f"tensors     {len(state)} matched" in printed
    assert f"finetune.init_checkpoint={output}" in printed
    with safe_open(str(output), "pt") as f:
        assert f.metadata()["arch"] == arch and set(f.keys()) == set(state)

    img_size = (128, 192) if arch.endswith("_4k") else (64, 48)
    backbone = build_backbone(arch, img_size=img_size).eval()
    load_checkpoint(backbone, output)
    ours = backbone.state_dict()
    for name, tensor in state.items():
        torch.testing.assert_close(ours[name], tensor.to(ours[name].dtype), rtol=0, atol=0, msg=name)
    pretrained = load_pretrained(source, img_size=img_size).eval()
    images = torch.randn(1, 3, *img_size)
    with torch.no_grad():
        out = backbone(images)
        assert torch.isfinite(out).all()
        assert torch.equal(pretrained(images), out)


def test_mismatch_lists_every_key(tmp_path, reference, capsys):
    state = reference_state(debug_layout(reference, 0), torch.float32)
    del state["blocks.3.attn.q_norm.weight"]
    state["blocks.3.attn.gamma.bias"] = torch.zeros(64)
    torch.save({"model": state}, tmp_path / "broken.pth")
    assert cli(["import-checkpoint", str(tmp_path / "broken.pth")]) == 1
    err = capsys.readouterr().err
    assert "does not match sapiens2_debug" in err
    assert "missing keys (1): blocks.3.attn.q_norm.weight" in err
    assert "unexpected keys (1): blocks.3.attn.gamma.bias" in err
    # An explicit arch of another size names the shape mismatches.
    shapes = r"blocks\.0\.attn\.proj\.weight: checkpoint \[64, 64\] vs model \[128, 128\]"
    with pytest.raises(CheckpointMismatchError, match=shapes) as mismatch:
        import_checkpoint(tmp_path / "broken.pth", arch="sapiens2_tiny")
    assert ("cls_token", (1, 1, 64), (1, 1, 128)) in mismatch.value.mismatched
    with pytest.raises(ValueError, match="safetensors"):
        import_checkpoint(tmp_path / "broken.pth", output=tmp_path / "out.pth")


def test_finetuning_starts_from_imported_checkpoint(tmp_path, reference):
    from pipelines.common.config import load_config
    from pipelines.common.task_models import backbone_weights, initial_model

    state = reference_state(debug_layout(reference, 0), torch.bfloat16, seed=3)
    save_file(state, str(tmp_path / "published.safetensors"))
    report = import_checkpoint(tmp_path / "published.safetensors", output=tmp_path / "init.safetensors")
    config = load_config(None, {"pretrain.arch": report.arch, "finetune.init_checkpoint": str(report.output)})
    path = backbone_weights(config, tmp_path / "our-pretraining")
    assert path == report.output
    model = initial_model(config, "seg", path)
    ours = model.backbone.state_dict()
    assert ours.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor.to(ours[name].dtype)), name
