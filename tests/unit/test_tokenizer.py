"""4K hierarchical variant: reference names/shapes, the 64x48 grid, per-window math, masking."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sapiens2.model import ARCHS, build_backbone
from sapiens2.model.tokenizer import window_partition, window_patch_index
from tests.unit.test_backbone import training_step_flops

LISTING = Path(__file__).resolve().parents[3] / "shared" / "reference" / "official_backbone_state_dicts.json"
PREFIX = 9
LOCAL_BLOCKS = {"sapiens2_0.1b": 2, "sapiens2_0.4b": 2, "sapiens2_0.8b": 3, "sapiens2_1b": 4, "sapiens2_5b": 6}


@pytest.fixture(scope="module")
def reference() -> dict:
    assert LISTING.is_file(), f"reference listing not found at {LISTING}"
    return json.loads(LISTING.read_text())


def meta_backbone(name: str, **overrides):
    with torch.device("meta"):
        return build_backbone(name, **overrides)


def test_1b_4k_names_shapes_and_count_equal_reference(reference):
    expected = reference["sapiens2_1b_4k"]
    backbone = meta_backbone("sapiens2_1b_4k")
    listing = {k: list(v.shape) for k, v in backbone.state_dict().items()}
    assert list(listing) == list(expected["state_dict"])  # same names, same order
    assert listing == expected["state_dict"]
    assert sum(p.numel() for p in backbone.parameters()) == expected["num_params"] == 1_606_588_928


@pytest.mark.parametrize("base", sorted(LOCAL_BLOCKS))
def test_every_size_has_its_local_blocks_in_the_reference_layout(base, reference):
    """The 1b_4k listing's tokenizer entries rescaled to the size's width, with its K copies of
    the listing's local block 0."""
    dim = ARCHS[base].embed_dim
    scale = {1536: dim, 6144: 4 * dim, 12288: 8 * dim}
    expected = {}
    for name, shape in reference["sapiens2_1b_4k"]["state_dict"].items():
        shape = [scale.get(s, s) for s in shape]
        if name.startswith("tokenizer.blocks.0."):
            for i in range(LOCAL_BLOCKS[base]):
                expected[name.replace(".0.", f".{i}.", 1)] = shape
        elif name.startswith("tokenizer.") and not name.startswith("tokenizer.blocks."):
            expected[name] = shape
    backbone = meta_backbone(f"{base}_4k")
    state = backbone.state_dict()
    tokenizer = {k: list(v.shape) for k, v in state.items() if k.startswith("tokenizer.")}
    assert tokenizer == expected
    # Everything else is the base model's layout unchanged.
    rest = {k: list(v.shape) for k, v in state.items() if not k.startswith("tokenizer.")}
    assert rest == reference[base]["state_dict"]


def test_4096x3072_gives_64x48_grid_on_meta_device():
    backbone = meta_backbone("sapiens2_1b_4k").eval()
    images = torch.empty(1, 3, 4096, 3072, device="meta")
    with torch.no_grad():
        assert backbone(images).shape == (1, 1536, 64, 48)
        assert backbone(images, "tokens").shape == (1, PREFIX + 64 * 48, 1536)
    assert backbone.config.grid_size == (64, 48) and backbone.patch_size == 64


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def local_block_reference(block, x, heads):
    """One local block written out: pre-norm MHSA (no QK-norm/RoPE/LayerScale), SwiGLU."""
    attn, n, dim = block.attn, x.shape[0], x.shape[1]
    h = rms(x, block.ln1.weight)
    q, k, v = (F.linear(h, m.weight, m.bias) for m in (attn.wq, attn.wk, attn.wv))
    outs = []
    for head in range(heads):
        cols = slice(head * dim // heads, (head + 1) * dim // heads)
        scores = q[:, cols] @ k[:, cols].T / math.sqrt(dim // heads)
        outs.append(torch.softmax(scores, dim=-1) @ v[:, cols])
    x = x + F.linear(torch.cat(outs, dim=-1), attn.proj.weight, attn.proj.bias)
    gate, value = F.linear(rms(x, block.ln2.weight), block.ffn.w12.weight, block.ffn.w12.bias).chunk(2, -1)
    return x + F.linear(F.silu(gate) * value, block.ffn.w3.weight, block.ffn.w3.bias)


def pooled_grid_reference(backbone, images):
    """Per-image, per-window loop: embed the window's 64x64 pixels, prepend the window CLS, add
    the local positions, run the local blocks, keep the CLS. Returns (B, windows, D)."""
    tok, conv = backbone.tokenizer, backbone.patch_embed.projection
    heads = backbone.config.num_heads
    batch, _, height, width = images.shape
    out = []
    for b in range(batch):
        row = []
        for top in range(0, height, 64):
            for left in range(0, width, 64):
                crop = images[b : b + 1, :, top : top + 64, left : left + 64]
                patches = conv(crop).flatten(2)[0].T  # (16, D), row-major inside the window
                x = torch.cat((tok.w_cls[0], patches)) + tok.local_pos_embed[0]
                for block in tok.blocks:
                    x = local_block_reference(block, x, heads)
                row.append(x[0])
        out.append(torch.stack(row))
    return torch.stack(out)


@pytest.fixture(scope="module")
def small_4k():
    torch.manual_seed(0)
    # Chunks of 5 windows over 2 images x 6 windows: the second chunk spans both images.
    backbone = build_backbone("sapiens2_debug_4k", img_size=(128, 192), window_chunk=5).eval()
    for name, p in backbone.named_parameters():  # non-trivial norms, so a skipped norm shows
        if name.endswith(("ln1.weight", "ln2.weight")):
            p.data.uniform_(0.5, 1.5)
    return backbone


def test_small_window_case_matches_per_window_loop(small_4k):
    # In float64: the batched and per-window paths take different kernels, and in float32 their
    # rounding differed by 5e-5 on one CI-like CPU; a wrong window order or a skipped norm is O(1).
    images = torch.randn(2, 3, 128, 192, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    backbone = copy.deepcopy(small_4k).double()
    with torch.no_grad():
        pooled = pooled_grid_reference(backbone, images)
        # Global stage as a plain ViT on the 2x3 pooled grid, RoPE on the pooled positions.
        prefix = torch.cat((backbone.cls_token, backbone.storage_tokens), dim=1).expand(2, -1, -1)
        x = torch.cat((prefix, pooled), dim=1)
        rope = backbone.rope_embed((2, 3))
        for block in backbone.blocks:
            x = block(x, rope)
        expected = backbone.ln1(x)
        tokens = backbone(images, "tokens")
        featmap = backbone(images)
    assert pooled.shape == (2, 6, 64)
    torch.testing.assert_close(tokens, expected, atol=1e-5, rtol=1e-5)
    assert featmap.shape == (2, 64, 2, 3)
    torch.testing.assert_close(featmap[:, :, 1, 2], tokens[:, PREFIX + 5])
    with pytest.raises(ValueError, match="64-px window"):
        backbone(torch.randn(1, 3, 128, 176))


def test_window_patch_index_follows_window_partition():
    grid = (8, 12)
    tokens = torch.arange(96.0).view(1, 96, 1).expand(2, -1, -1)
    windows = window_partition(tokens, grid, 4)  # (2, 6, 16, 1)
    assert windows[0, 4, :, 0].tolist()[:5] == [52.0, 53.0, 54.0, 55.0, 64.0]  # window (1, 1)
    keep = torch.tensor([[4, 0], [5, 2]])
    index = window_patch_index(keep, grid, 4).view(2, 2, 16)
    for b in range(2):
        for j in range(2):
            assert index[b, j].tolist() == windows[b, keep[b, j], :, 0].long().tolist()


def test_training_chunks_are_recomputed_and_grads_unchanged(small_4k):
    backbone = build_backbone("sapiens2_debug_4k", img_size=(128, 192), window_chunk=5)
    backbone.load_state_dict(small_4k.state_dict())
    images = torch.randn(2, 3, 128, 192)
    calls = []
    backbone.tokenizer.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    grads = {}
    for mode in ("eval", "train"):
        getattr(backbone, mode)()
        backbone.zero_grad()
        calls.clear()
        backbone(images).square().mean().backward()
        grads[mode] = ({n: p.grad.clone() for n, p in backbone.named_parameters()}, len(calls))
    assert grads["eval"][1] == 3  # 12 windows in chunks of 5
    assert grads["train"][1] == 6  # each chunk runs again in the backward pass
    for name, grad in grads["eval"][0].items():
        torch.testing.assert_close(grads["train"][0][name], grad, msg=name)
    assert grads["train"][0]["tokenizer.w_cls"].abs().sum() > 0


def test_visible_windows_only(small_4k):
    backbone = small_4k
    images = torch.randn(2, 3, 128, 192, generator=torch.Generator().manual_seed(2))
    perm = torch.stack([torch.randperm(6), torch.randperm(6)])
    keep = torch.tensor([[1, 4], [0, 5]])
    changed = images.clone()
    for b in range(2):  # rewrite every pixel of the dropped windows
        for w in set(range(6)) - set(keep[b].tolist()):
            top, left = (w // 3) * 64, (w % 3) * 64
            changed[b, :, top : top + 64, left : left + 64] = torch.randn(3, 64, 64) * 5
    with torch.no_grad():
        full = backbone.forward_tokens(images)
        shuffled = backbone.forward_tokens(images, perm)
        visible = backbone.forward_tokens(images, keep)
        visible_changed = backbone.forward_tokens(changed, keep)
    expected = torch.stack([full[b, PREFIX + perm[b]] for b in range(2)])
    torch.testing.assert_close(shuffled[:, PREFIX:], expected, atol=1e-5, rtol=1e-5)
    assert visible.shape == (2, PREFIX + 2, 64)
    torch.testing.assert_close(visible_changed, visible)


def test_masked_4k_step_costs_under_half_of_full_step():
    backbone = build_backbone("sapiens2_debug_4k", img_size=(256, 192))
    images = torch.randn(1, 3, 256, 192)
    keep = torch.randperm(12)[:3].unsqueeze(0)  # mask ratio 0.75 on the 4x3 pooled grid
    assert training_step_flops(backbone, images, keep) < 0.5 * training_step_flops(backbone, images, None)


def test_4k_config_and_optimiser_groups():
    assert {n: ARCHS[f"{n}_4k"].tokenizer_blocks for n in LOCAL_BLOCKS} == LOCAL_BLOCKS
    assert ARCHS["sapiens2_1b_4k"].img_size == (4096, 3072)
    assert ARCHS["sapiens2_1b"].tokenizer_blocks == 0 and ARCHS["sapiens2_1b"].token_stride == 16
    with pytest.raises(ValueError, match="64-px window"):
        build_backbone("sapiens2_debug_4k", img_size=(128, 96))
    with pytest.raises(ValueError, match="window_chunk"):
        build_backbone("sapiens2_debug_4k", img_size=(128, 128), window_chunk=0)
    backbone = meta_backbone("sapiens2_debug_4k", img_size=(128, 128))
    assert backbone.layer_id("tokenizer.blocks.1.ffn.w3.weight") == 0
    assert backbone.layer_id("blocks.0.attn.wq.weight") == 1
    assert {"tokenizer.w_cls", "tokenizer.local_pos_embed"} <= backbone.no_weight_decay()
    block = backbone.tokenizer.blocks[0]
    names = {n for n, _ in block.named_parameters()}
    assert not any("norm" in n or "gamma" in n for n in names)
