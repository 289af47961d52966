"""The masked position-prediction branch: position-free encoding, its loss, its place in the
objective and in the recipe's random stream."""

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from sapiens2.model import build_backbone
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.teacher import build_teacher, teacher_output
from sapiens2.pretrain.position import draw_position_idx, encode_unplaced, position_logits, position_loss
from sapiens2.pretrain.recipe import PretrainRecipe, build_centering
from tests.unit.test_pretrain_objective import GLOBAL, SMALL, make_batch, make_student
from tests.unit.test_pretrain_objective import single_thread  # noqa: F401 (autouse: debug tensors, one thread)

GRID_CELLS = (GLOBAL[0] // 16) * (GLOBAL[1] // 16)


def _backbone() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_backbone("sapiens2_debug", img_size=GLOBAL).eval()


def test_position_free_tokens_follow_their_patches_not_their_place():
    """Without positions, reordering the visible patches only reorders their outputs; with RoPE
    the same reordering changes what each patch computes."""
    backbone, images = _backbone(), torch.randn(2, 3, *GLOBAL)
    cells = draw_position_idx(2, GRID_CELLS, 0.5, torch.Generator().manual_seed(0))
    order = torch.randperm(cells.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        free = backbone.forward_tokens(images, cells, positions=False)[:, backbone.num_prefix_tokens:]
        free_reordered = backbone.forward_tokens(images, cells[:, order], positions=False)[:, backbone.num_prefix_tokens:]
        placed = backbone.forward_tokens(images, cells)[:, backbone.num_prefix_tokens:]
    torch.testing.assert_close(free_reordered, free[:, order], rtol=1e-4, atol=1e-5)
    assert (placed - free).abs().max() > 1e-3


def test_draw_position_idx_is_a_seeded_subset_without_repeats():
    cells = draw_position_idx(3, GRID_CELLS, 0.5, torch.Generator().manual_seed(0))
    assert cells.shape == (3, GRID_CELLS // 2) and cells.dtype == torch.long
    assert all(len(set(row.tolist())) == cells.shape[1] for row in cells)
    assert int(cells.min()) >= 0 and int(cells.max()) < GRID_CELLS
    torch.testing.assert_close(cells, draw_position_idx(3, GRID_CELLS, 0.5, torch.Generator().manual_seed(0)))


def test_position_loss_is_chance_for_uniform_logits_and_low_for_the_truth():
    cells = torch.tensor([[0, 5, 7]])
    assert position_loss(torch.zeros(1, 3, 12), cells).item() == pytest.approx(math.log(12), rel=1e-5)
    right = torch.nn.functional.one_hot(cells, 12).float() * 5
    wrong = torch.nn.functional.one_hot((cells + 1) % 12, 12).float() * 5
    assert position_loss(right, cells).item() < 0.5 * math.log(12) < math.log(12) < position_loss(wrong, cells).item()


def test_branch_is_absent_by_default_and_its_loss_is_zero():
    student = make_student()
    assert not hasattr(student, "position_head")
    batch = make_batch()
    teacher = build_teacher(student)
    targets = teacher_output(teacher, batch["global_crops"], batch["mask_idx"], build_centering(student.cfg), 0.04)
    out = student(batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"], targets)
    assert out["loss_position"].item() == 0.0


def test_branch_adds_its_weighted_loss_and_trains_the_backbone():
    student = make_student(position_weight=0.5)
    assert student.position_head.out_features == GRID_CELLS
    batch = make_batch()
    teacher = build_teacher(student)
    targets = teacher_output(teacher, batch["global_crops"], batch["mask_idx"], build_centering(student.cfg), 0.04)
    g = torch.Generator().manual_seed(0)
    cells = [draw_position_idx(4, GRID_CELLS, 0.5, g) for _ in batch["global_crops"]]
    with pytest.raises(ValueError, match="position_idx"):
        student(batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"], targets)
    out = student(batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"], targets, cells)
    # A fresh head is near chance: ln(cells).
    assert out["loss_position"].item() == pytest.approx(math.log(GRID_CELLS), rel=0.1)
    others = (out["loss_mae"] + student.cfg.cl_weight * out["loss_cl"] + student.cfg.ibot_weight * out["loss_ibot"]
              + student.cfg.koleo_weight * out["loss_koleo"])
    torch.testing.assert_close(out["loss"], others + 0.5 * out["loss_position"])
    out["loss_position"].backward()
    assert student.backbone.patch_embed.projection.weight.grad.abs().sum() > 0


def test_position_loss_falls_when_trained_on_a_fixed_batch():
    """The branch can learn: 30 steps on one batch of structured images (a bright band whose
    place says where a patch is) bring the loss well under chance."""
    torch.manual_seed(0)
    backbone = build_backbone("sapiens2_debug", img_size=GLOBAL)
    head = torch.nn.Linear(backbone.embed_dim, GRID_CELLS)
    rows = torch.linspace(-1, 1, GLOBAL[0])[:, None].expand(GLOBAL)
    cols = torch.linspace(-1, 1, GLOBAL[1])[None, :].expand(GLOBAL)
    images = torch.stack([rows, cols, rows * cols]).expand(4, -1, -1, -1).contiguous()
    params = list(backbone.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=2e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        cells = draw_position_idx(4, GRID_CELLS, 0.5, g)
        loss = position_loss(position_logits(backbone, head, encode_unplaced(backbone, images, cells)), cells)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(GRID_CELLS)
    assert np.mean(losses[-5:]) < 0.6 * math.log(GRID_CELLS)


class RecordingEngine:
    """Stands in for the DeepSpeed engine in `PretrainRecipe.loss`: keeps each call's arguments
    (global crops, local crops, keep, masked, teacher targets, position cells) instead of training."""

    device = torch.device("cpu")

    def __init__(self, module, calls: list):
        self.module, self.calls = module, calls

    def __call__(self, *args):
        self.calls.append(args)
        return {}

    def bfloat16_enabled(self):
        return False


def test_recipe_passes_cells_only_when_the_branch_is_on():
    calls = []

    images = np.random.default_rng(0).integers(0, 256, (6, *GLOBAL, 3), dtype=np.uint8)
    for weight in (0.0, 1.0):
        student = make_student(position_weight=weight)
        recipe = PretrainRecipe(RecordingEngine(student, calls), build_teacher(student), student.cfg, images, GLOBAL, 2, 10)
        recipe.loss(0, torch.Generator().manual_seed(0))
    seen = [args[-1] for args in calls]
    assert seen[0] is None
    assert len(seen[1]) == 2 and seen[1][0].shape == (2, GRID_CELLS // 2)


def test_config_bounds_name_the_field():
    with pytest.raises(ValidationError, match="position_keep_ratio"):
        ObjectiveConfig(**SMALL, position_keep_ratio=0.0)
    with pytest.raises(ValidationError, match="position_weight"):
        ObjectiveConfig(**SMALL, position_weight=-1.0)
