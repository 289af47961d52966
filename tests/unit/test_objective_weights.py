"""Objective terms with weight 0 cost nothing: no teacher without a distillation term, no masked
view or decoder without a term that reads them; ``mae_weight`` scales the reconstruction term;
``mae_view='position'`` runs one encoder pass for the position and reconstruction terms."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pipelines.common import plots
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.data.normalize import normalize
from sapiens2.pretrain.mae import mae_loss, patchify
from sapiens2.pretrain.meta_arch import MONITOR_KEYS
from sapiens2.pretrain.teacher import build_teacher, teacher_output
from sapiens2.pretrain.position import draw_position_idx
from sapiens2.pretrain.recipe import PretrainRecipe, build_centering
from tests.unit.test_position_pretext import RecordingEngine
from tests.unit.test_pretrain_objective import GLOBAL, SMALL, make_batch, make_student
from tests.unit.test_pretrain_objective import single_thread  # noqa: F401 (autouse: debug tensors, one thread)

POSITION_ONLY = dict(position_weight=1.0, mae_weight=0.0, cl_weight=0.0, ibot_weight=0.0, koleo_weight=0.0)
GRID_CELLS = (GLOBAL[0] // 16) * (GLOBAL[1] // 16)


def _cells(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [draw_position_idx(4, GRID_CELLS, 0.5, g) for _ in range(2)]


def test_position_only_runs_neither_teacher_nor_masked_view():
    student = make_student(**POSITION_ONLY)
    assert not student.cfg.uses_teacher and not student.cfg.uses_masked_view
    batch = make_batch()
    out = student(batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"], None, _cells())
    out["loss"].backward()
    torch.testing.assert_close(out["loss"], out["loss_position"])
    assert all(out[key].item() == 0.0 for key in ("loss_mae", "loss_cl", "loss_ibot", "loss_koleo"))
    assert not set(MONITOR_KEYS) & set(out)  # nothing to watch without a teacher or a CLS view
    # The decoder and the CLS head took no part; the backbone and the position head did.
    for name in ("mae_decoder", "dino_head"):
        assert all(p.grad is None for p in getattr(student, name).parameters()), name
    assert student.position_head.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in student.backbone.blocks.parameters())


def test_mae_weight_scales_the_reconstruction_term():
    batch = make_batch()
    args = (batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"])
    student = make_student(mae_weight=0.25, cl_weight=0.0, ibot_weight=0.0, koleo_weight=0.0)
    with torch.no_grad():
        out = student(*args, None)
    assert out["loss_mae"].item() > 0
    torch.testing.assert_close(out["loss"], 0.25 * out["loss_mae"])
    assert set(out) >= {"cls_std"} and "teacher_entropy" not in out  # the CLS view still runs


def test_a_distillation_term_needs_the_teacher():
    student = make_student()
    batch = make_batch()
    with pytest.raises(ValueError, match="teacher's targets"):
        student(batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"], None)
    teacher = build_teacher(student)
    targets = teacher_output(teacher, batch["global_crops"], batch["mask_idx"], build_centering(student.cfg), 0.04)
    with torch.no_grad():
        out = student(batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"], targets)
    assert set(MONITOR_KEYS) <= set(out)


def test_recipe_asks_the_teacher_only_for_a_distillation_term():
    calls = []
    images = np.random.default_rng(0).integers(0, 256, (6, *GLOBAL, 3), dtype=np.uint8)
    for objective in (POSITION_ONLY, {}):
        student = make_student(**objective)
        teacher = build_teacher(student)
        teacher.register_forward_hook(lambda *_: calls.append("teacher ran"))
        engine = RecordingEngine(student, [])
        PretrainRecipe(engine, teacher, student.cfg, images, GLOBAL, 2, 10).loss(0, torch.Generator())
        calls.append(engine.calls[0][4])  # the teacher's targets
    assert calls[0] is None
    assert calls[1] == "teacher ran" and set(calls[2]) == {"cls_probs", "patch_probs"}


def test_an_objective_with_every_weight_zero_is_rejected():
    with pytest.raises(ValidationError, match="all 0"):
        ObjectiveConfig(**SMALL, **{**POSITION_ONLY, "position_weight": 0.0})
    with pytest.raises(ValidationError, match="mae_weight"):
        ObjectiveConfig(**SMALL, mae_weight=-1.0)


def test_mae_on_the_position_pass_reconstructs_the_cells_that_pass_left_out():
    student = make_student(**{**POSITION_ONLY, "mae_weight": 1.0, "mae_view": "position"})
    assert not student.cfg.uses_masked_view
    passes, encode = [], student.backbone.forward_tokens

    def recording_encode(*args, **kwargs):
        passes.append(kwargs.get("positions", True))
        return encode(*args, **kwargs)

    student.backbone.forward_tokens = recording_encode
    batch, cells = make_batch(), _cells()
    inputs = (batch["global_crops"], batch["local_crops"], batch["keep_idx"], batch["mask_idx"])
    out = student.student_output(*inputs, cells)
    assert passes == [False]  # one encoder pass, without positions, for both terms
    seen, hidden = out["position_idx"], out["mae_idx"]
    assert (torch.cat([seen, hidden], 1).sort(1).values == torch.arange(GRID_CELLS)).all()
    losses = student.losses(out, None)
    torch.testing.assert_close(losses["loss"], losses["loss_mae"] + losses["loss_position"])
    # The batch's own masks play no part: the MAE term scores the position pass's hidden cells.
    images = torch.cat(batch["global_crops"])
    expected = mae_loss(out["pixel_pred"], images, hidden, student.backbone.patch_size)
    torch.testing.assert_close(losses["loss_mae"], expected)
    losses["loss"].backward()
    assert all(p.grad is not None for p in student.mae_decoder.parameters())
    assert all(p.grad is None for p in student.dino_head.parameters())
    # mae_target reaches the loss: the same predictions scored against the pixels as they are.
    student.cfg = student.cfg.model_copy(update={"mae_target": "pixels"})
    pixels = student.losses(out, None)
    torch.testing.assert_close(pixels["loss_mae"], mae_loss(out["pixel_pred"], images, hidden, 16, "pixels"))
    assert not torch.allclose(pixels["loss_mae"], losses["loss_mae"])


def test_the_reconstruction_picture_follows_the_view_the_decoder_trained_on():
    images = np.zeros((2, *GLOBAL, 3), dtype=np.uint8)
    for view, positions in (("masked", True), ("position", False)):
        student = make_student(**{**POSITION_ONLY, "mae_weight": 1.0, "mae_view": view})
        engine = RecordingEngine(student, [])
        recipe = PretrainRecipe(engine, build_teacher(student), student.cfg, images, GLOBAL, 2, 10)
        keep, hidden, with_positions = recipe.reconstruction_view(2, torch.Generator().manual_seed(0))
        assert with_positions is positions
        assert (torch.cat([keep, hidden], 1).sort(1).values == torch.arange(GRID_CELLS)).all()
    assert hidden.shape[1] == GRID_CELLS - round(0.5 * GRID_CELLS)  # the position branch's keep ratio


class _PixelOracle(torch.nn.Module):
    """An MAE decoder that predicts the hidden patches' exact "pixels" target."""

    def __init__(self, patches: torch.Tensor) -> None:
        super().__init__()
        self.patches = patches

    def forward(self, tokens, keep, masked, grid):
        return self.patches.gather(1, masked[..., None].expand(-1, -1, self.patches.shape[-1]))


def test_the_reconstruction_picture_shows_pixel_targets_as_pixels(monkeypatch, tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (2, *GLOBAL, 3), dtype=np.uint8)
    student = make_student(**{**POSITION_ONLY, "mae_weight": 1.0, "mae_view": "position", "mae_target": "pixels"})
    pixels = torch.as_tensor(images).permute(0, 3, 1, 2).float()
    student.mae_decoder = _PixelOracle(patchify(normalize(pixels), 16))
    shown = {}
    monkeypatch.setattr(plots, "image_grid_png", lambda rows, path, **kw: shown.setdefault("rows", rows) and path)
    recipe = PretrainRecipe(RecordingEngine(student, []), build_teacher(student), student.cfg, images, GLOBAL, 2, 10)
    view = recipe.reconstruction_view(2, torch.Generator().manual_seed(0))
    plots.mae_reconstruction_png(student, images, view, tmp_path / "recon.png", "pixels")
    for original, hidden, reconstruction in shown["rows"]:
        assert not np.array_equal(hidden, original)
        assert np.abs(reconstruction.astype(int) - original.astype(int)).max() <= 1  # uint8 rounding


def test_mae_on_the_position_pass_needs_that_pass():
    with pytest.raises(ValidationError, match="position_weight"):
        ObjectiveConfig(**SMALL, mae_view="position")
