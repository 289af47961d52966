"""Parts of the self-distillation objective: centring, KoLeo, collapse monitors, schedules, the
frozen prototype layer and the iBOT (masked-patch) branch."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sapiens2.model import build_backbone
from sapiens2.pretrain.centering import Centering, TeacherCenter, sinkhorn_knopp
from sapiens2.pretrain.config import ObjectiveConfig
from sapiens2.pretrain.koleo import koleo_loss
from sapiens2.pretrain.masking import MaskGenerator, mask_to_indices
from sapiens2.pretrain.meta_arch import PretrainStudent
from sapiens2.pretrain.teacher import build_teacher, teacher_output
from sapiens2.pretrain.monitors import (
    agreement,
    collapse_verdict,
    entropy,
    feature_std,
    marginal_entropy,
)
from sapiens2.pretrain.schedules import (
    ema_momentum_start,
    freeze_last_layer_steps,
    objective_schedules,
    pretrain_param_groups,
)
from sapiens2.train.config import OptimSection
from sapiens2.train.engine import set_lr

GLOBAL = (64, 48)
SMALL = dict(dino_out_dim=64, ibot_out_dim=32, dino_hidden_dim=32, dino_bottleneck_dim=16,
             decoder_dim=32, decoder_depth=1, decoder_heads=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def cosine_logits(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Logits in [-1, 1], the range of the heads' cosine similarities."""
    return torch.rand(n, k, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def one_prototype_logits(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Every sample's best prototype is prototype 0 by a wide margin: a collapsing teacher."""
    g = torch.Generator().manual_seed(seed)
    logits = 0.1 * torch.randn(n, k, generator=g)
    logits[:, 0] += 1.0
    return logits


def make_student(seed: int = 0, **objective) -> PretrainStudent:
    torch.manual_seed(seed)
    backbone = build_backbone("sapiens2_debug", img_size=GLOBAL)
    return PretrainStudent(backbone, ObjectiveConfig(**{**SMALL, **objective}))


def make_views(batch: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    masks = MaskGenerator((GLOBAL[0] // 16, GLOBAL[1] // 16), 0.75, 0.4)
    indices = [mask_to_indices(masks(batch, g)) for _ in range(2)]
    return {
        "global_crops": [torch.randn(batch, 3, *GLOBAL, generator=g) for _ in range(2)],
        "local_crops": [torch.randn(batch, 3, 32, 32, generator=g)],
        "keep_idx": [keep for keep, _ in indices],
        "mask_idx": [masked for _, masked in indices],
    }


def run(student, teacher, views, centering):
    targets = teacher_output(teacher, views["global_crops"], views["mask_idx"], centering, 0.04)
    with torch.no_grad():
        losses = student(views["global_crops"], views["local_crops"], views["keep_idx"],
                         views["mask_idx"], targets)
    return targets, losses


# Sinkhorn-Knopp


def test_sinkhorn_rows_are_distributions_and_prototypes_equipartitioned():
    n, k = 256, 32
    logits = cosine_logits(n, k)
    q = sinkhorn_knopp(logits, temp=0.07, iterations=3)
    assert q.shape == (n, k) and (q >= 0).all()
    torch.testing.assert_close(q.sum(1), torch.ones(n))
    # Each prototype should receive n / k samples' worth of mass; softmax alone is far from it.
    sk_spread = (q.sum(0) / (n / k) - 1).abs().max()
    softmax_spread = (torch.softmax(logits / 0.07, -1).sum(0) / (n / k) - 1).abs().max()
    assert sk_spread < 0.15
    assert sk_spread < softmax_spread / 3
    # More iterations converge to exact equipartition.
    exact = sinkhorn_knopp(logits, temp=0.07, iterations=30)
    torch.testing.assert_close(exact.sum(0), torch.full((k,), n / k), rtol=1e-3, atol=0)


@pytest.mark.parametrize("n, k", [(8, 256), (16, 256), (4, 32)])
def test_sinkhorn_spreads_each_sample_when_batch_is_smaller_than_prototypes(n, k):
    # Every prototype gets n / k < 1 of a sample, so no sample can put more than ~n / k on one.
    for logits in (cosine_logits(n, k), one_prototype_logits(n, k)):
        q = sinkhorn_knopp(logits, temp=0.04, iterations=3)
        per_sample = -(q * q.clamp_min(1e-12).log()).sum(-1)
        assert per_sample.min() >= math.log(k / n) - 0.1


def test_sinkhorn_ignores_constant_and_per_prototype_offsets():
    logits = cosine_logits(10, 8)
    base = sinkhorn_knopp(logits, temp=0.05)
    torch.testing.assert_close(sinkhorn_knopp(logits + 5.0, temp=0.05), base)
    # A bias towards some prototypes (the thing EMA centring subtracts) cancels exactly.
    bias = torch.linspace(-0.5, 0.5, 8)
    torch.testing.assert_close(sinkhorn_knopp(logits + bias, temp=0.05), base)
    assert not torch.allclose(TeacherCenter(8).targets(logits + bias, 0.05),
                              TeacherCenter(8).targets(logits, 0.05))


def test_sinkhorn_spreads_a_collapsing_teacher_where_ema_centring_cannot_yet():
    n, k, temp = 64, 16, 0.04
    logits = one_prototype_logits(n, k)
    assert (torch.softmax(logits / temp, -1).argmax(-1) == 0).all()

    sk = sinkhorn_knopp(logits, temp)
    assert marginal_entropy(sk) > math.log(k) - 0.05
    assert sk.argmax(-1).unique().numel() >= k // 2

    # EMA centring starts from a zero centre and moves 10% a step: the first targets collapse.
    center = TeacherCenter(k, momentum=0.9)
    assert marginal_entropy(center.targets(logits, temp)) < 0.1
    center.update(logits.mean(0))
    assert marginal_entropy(center.targets(logits, temp)) < 0.1
    # Only once the centre has converged to the mean logits are the targets spread too.
    for _ in range(100):
        center.update(logits.mean(0))
    assert marginal_entropy(center.targets(logits, temp)) > math.log(k) - 0.5


# Centering


def test_ema_centering_moves_each_centre_by_the_mean_logits_seen():
    centering = Centering("ema", cls_dim=8, patch_dim=4, momentum=0.9)
    a, b = cosine_logits(6, 8, seed=1), cosine_logits(6, 8, seed=2)
    patch = cosine_logits(10, 4, seed=3)
    torch.testing.assert_close(centering.targets(a, 0.1), torch.softmax(a / 0.1, -1))
    centering.targets(b, 0.1)  # a second micro-batch before the optimizer step
    centering.targets(patch, 0.1, "patch")
    centering.update()
    expected_cls = 0.1 * (a.mean(0) + b.mean(0)) / 2
    torch.testing.assert_close(centering.cls.center, expected_cls.view(1, -1))
    torch.testing.assert_close(centering.patch.center, 0.1 * patch.mean(0).view(1, -1))
    torch.testing.assert_close(
        centering.targets(a, 0.1), torch.softmax((a - expected_cls) / 0.1, -1)
    )
    patch_center = centering.patch.center.clone()
    centering.update()
    moved = 0.9 * expected_cls + 0.1 * a.mean(0)
    torch.testing.assert_close(centering.cls.center, moved.view(1, -1))
    # What was seen is consumed by an update: no patch logits this step, no patch update.
    assert torch.equal(centering.patch.center, patch_center)
    before = centering.cls.center.clone()
    centering.update()
    assert torch.equal(centering.cls.center, before)


def test_ema_centering_state_dict_round_trip():
    centering = Centering("ema", cls_dim=8, patch_dim=4, momentum=0.9)
    centering.targets(cosine_logits(6, 8), 0.1)
    centering.targets(cosine_logits(5, 4), 0.1, "patch")
    centering.update()
    state = centering.state_dict()
    assert set(state) == {"cls.center", "patch.center"}
    restored = Centering("ema", cls_dim=8, patch_dim=4, momentum=0.9)
    restored.load_state_dict(state)
    logits = cosine_logits(3, 8, seed=7)
    assert torch.equal(restored.targets(logits, 0.1), centering.targets(logits, 0.1))
    assert not torch.equal(restored.targets(logits, 0.1), Centering("ema", 8, 4).targets(logits, 0.1))


def test_sinkhorn_centering_is_stateless():
    centering = Centering("sinkhorn_knopp", cls_dim=8, patch_dim=4, iterations=5)
    logits = cosine_logits(12, 8)
    targets = centering.targets(logits, 0.05)
    torch.testing.assert_close(targets, sinkhorn_knopp(logits, 0.05, iterations=5))
    before = {k: v.clone() for k, v in centering.state_dict().items()}
    centering.update()
    assert all(torch.equal(v, before[k]) for k, v in centering.state_dict().items())
    assert torch.equal(centering.targets(logits, 0.05), targets)


def test_unknown_centering_raises():
    with pytest.raises(ValueError, match="unknown centering 'softmax'"):
        Centering("softmax", cls_dim=8)


# KoLeo


def test_koleo_penalises_identical_features():
    identical = torch.randn(1, 16).repeat(8, 1)
    spread = torch.eye(8, 16) * 3.0  # orthonormal directions; the scale is normalised away
    loss_spread = koleo_loss(spread)
    torch.testing.assert_close(loss_spread, torch.tensor(-math.log(math.sqrt(2))), atol=1e-5, rtol=0)
    assert koleo_loss(identical) > loss_spread + 10.0


def test_koleo_needs_two_features():
    with pytest.raises(ValueError, match="at least 2"):
        koleo_loss(torch.randn(1, 16))


@pytest.mark.parametrize("collapsed", [False, True])
def test_koleo_gradient_is_finite(collapsed: bool):
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1 if collapsed else 8, 16, generator=g).repeat(8 if collapsed else 1, 1)
    features.requires_grad_(True)
    koleo_loss(features).backward()
    assert torch.isfinite(features.grad).all()
    if not collapsed:
        assert features.grad.abs().sum() > 0


# Monitors


def test_entropy_and_marginal_entropy():
    k = 16
    assert entropy(torch.full((4, k), 1 / k)).item() == pytest.approx(math.log(k))
    assert entropy(torch.eye(k)[:4]).item() == pytest.approx(0.0, abs=1e-6)
    # Four one-hot rows on four prototypes: each row certain, the batch uses four.
    assert marginal_entropy(torch.eye(k)[:4]).item() == pytest.approx(math.log(4))
    same = torch.eye(k)[[2, 2, 2, 2]]
    assert marginal_entropy(same).item() == pytest.approx(0.0, abs=1e-6)


def test_agreement():
    teacher = torch.eye(5)[[0, 1, 2, 3]]
    student = torch.eye(5)[[0, 1, 2, 4]] * 3.0 - 1.0
    assert agreement(student, teacher).item() == pytest.approx(0.75)
    assert agreement(teacher, teacher).item() == 1.0


def test_feature_std():
    g = torch.Generator().manual_seed(0)
    assert feature_std(torch.randn(1, 256, generator=g).repeat(32, 1)).item() < 1e-5
    assert feature_std(torch.randn(512, 1024, generator=g)).item() == pytest.approx(1.0, abs=0.05)
    # Norms are irrelevant: only directions count.
    rows = torch.randn(512, 1024, generator=g)
    scaled = rows * torch.rand(512, 1, generator=g) * 100
    assert feature_std(scaled).item() == pytest.approx(feature_std(rows).item(), rel=1e-4)


def test_collapse_verdict():
    k = 1024
    verdict = collapse_verdict(math.log(k) - 0.5, cls_std=0.8, num_prototypes=k)
    assert verdict is not None and "uniform teacher" in verdict
    verdict = collapse_verdict(2.0, cls_std=0.05, num_prototypes=k)
    assert verdict is not None and "one embedding" in verdict
    assert collapse_verdict(2.0, cls_std=0.8, num_prototypes=k) is None
    assert collapse_verdict(math.log(k) - 1.1, cls_std=0.11, num_prototypes=k) is None


# Schedules


def test_ema_momentum_start_is_a_fraction_of_the_run():
    cfg = ObjectiveConfig(ema_time_constant_fraction=0.05)
    assert ema_momentum_start(cfg, 150) == pytest.approx(1 - 1 / 7.5)
    assert ema_momentum_start(cfg, 1_000_000) == pytest.approx(0.994)
    assert ema_momentum_start(cfg, 10) == 0.0  # time constant clipped to one step
    schedules = objective_schedules(cfg, 150)
    assert schedules["ema_momentum"][0] == pytest.approx(1 - 1 / 7.5)
    assert schedules["ema_momentum"][-1] == pytest.approx(1.0)
    assert (np.diff(schedules["ema_momentum"]) >= 0).all()


@pytest.mark.parametrize("steps, fraction", [(150, 0.2), (150, 0.3), (1000, 0.05), (7, 0.0)])
def test_teacher_temp_warmup_length_is_a_fraction_of_the_run(steps: int, fraction: float):
    cfg = ObjectiveConfig(teacher_temp_warmup_fraction=fraction)
    temps = objective_schedules(cfg, steps)["teacher_temp"]
    warmup = round(fraction * steps)
    assert temps.shape == (steps,)
    assert (temps[warmup:] == cfg.teacher_temp).all()
    assert (temps[:warmup] < cfg.teacher_temp).all()
    if warmup:
        assert temps[0] == cfg.teacher_temp_warmup_start


def test_freeze_last_layer_steps():
    assert freeze_last_layer_steps(ObjectiveConfig(freeze_last_layer_fraction=0.05), 1000) == 50
    assert freeze_last_layer_steps(ObjectiveConfig(freeze_last_layer_fraction=0.1), 150) == 15
    assert freeze_last_layer_steps(ObjectiveConfig(freeze_last_layer_fraction=0.0), 1000) == 0


# Frozen prototypes


def test_prototypes_are_frozen_and_never_decayed():
    student = make_student()
    # What pretraining (pipelines and calibration scripts) builds: 5 of 100 steps frozen.
    groups = pretrain_param_groups(student, OptimSection(lr=1e-3, weight_decay=0.05, layer_decay=0.8),
                                   ObjectiveConfig(freeze_last_layer_fraction=0.05), total_steps=100)
    names = {id(p): n for n, p in student.named_parameters()}
    prototypes = {n for n in names.values() if n.endswith("prototypes")}
    assert prototypes == {"dino_head.prototypes", "ibot_head.prototypes"}
    frozen = [g for g in groups if g["frozen_until"] > 0]
    assert {names[id(p)] for g in frozen for p in g["params"]} == prototypes
    assert all(g["frozen_until"] == 5 and g["weight_decay"] == 0.0 for g in frozen)
    assert sum(len(g["params"]) for g in groups) == len(names)
    assert any(g["weight_decay"] == 0.05 for g in groups)

    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups))
    set_lr(engine, 2e-3, step=4)
    for g in groups:
        assert g["lr"] == (0.0 if g["frozen_until"] else pytest.approx(2e-3 * g["lr_scale"]))
    set_lr(engine, 2e-3, step=5)
    assert all(g["lr"] == pytest.approx(2e-3 * g["lr_scale"]) for g in groups)
    assert all(g["lr"] > 0 for g in frozen)
    # Without a step (fine-tuning) nothing is held back, even right after a frozen step.
    set_lr(engine, 1e-3, step=4)
    assert all(g["lr"] == 0.0 for g in frozen)
    set_lr(engine, 1e-3)
    assert all(g["lr"] == pytest.approx(1e-3 * g["lr_scale"]) for g in groups)


# iBOT


def test_no_patch_branch_without_ibot_weight():
    student = make_student(ibot_weight=0.0)
    assert not hasattr(student, "ibot_head") and not hasattr(student, "patch_predictor")
    names = [n for n, _ in student.named_parameters()]
    assert not any(n.startswith(("ibot_head.", "patch_predictor.")) for n in names)
    teacher = build_teacher(student)
    assert teacher.ibot_head is None
    targets, losses = run(student, teacher, make_views(), Centering("sinkhorn_knopp", 64))
    assert targets["patch_probs"] is None
    assert losses["loss_ibot"].item() == 0.0
    assert losses["loss_cl"].item() > 0.0
    torch.testing.assert_close(
        losses["loss"],
        losses["loss_mae"] + losses["loss_cl"] + student.cfg.koleo_weight * losses["loss_koleo"],
    )


def test_patch_targets_come_from_the_teachers_patch_head_at_masked_positions():
    student = make_student()
    teacher = build_teacher(student)
    views = make_views(batch=2)
    centering = Centering("sinkhorn_knopp", 64, 32)
    targets, losses = run(student, teacher, views, centering)
    n_mask = views["mask_idx"][0].shape[1]
    assert targets["patch_probs"].shape == (4, n_mask, 32)
    torch.testing.assert_close(targets["patch_probs"].sum(-1), torch.ones(4, n_mask))
    # The teacher reads its own full-image tokens at the student's masked positions.
    images, masked = torch.cat(views["global_crops"]), torch.cat(views["mask_idx"])
    with torch.no_grad():
        tokens = teacher.backbone.forward_tokens(images)
        patches = tokens[:, teacher.backbone.num_prefix_tokens:]
        full = teacher.ibot_head(patches)
    picked = full.gather(1, masked[..., None].expand(-1, -1, 32)).flatten(0, 1)
    torch.testing.assert_close(targets["patch_probs"].flatten(0, 1), sinkhorn_knopp(picked, 0.04))

    with torch.no_grad():
        teacher.ibot_head.prototypes.copy_(torch.randn_like(teacher.ibot_head.prototypes))
    changed_targets, changed = run(student, teacher, views, centering)
    for a, b in zip(changed_targets["cls_probs"], targets["cls_probs"], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(changed["loss_cl"], losses["loss_cl"])
    assert torch.equal(changed["loss_mae"], losses["loss_mae"])
    assert (changed["loss_ibot"] - losses["loss_ibot"]).abs() > 1e-4

    # The student side: the patch predictor feeds loss_ibot only.
    with torch.no_grad():
        student.patch_predictor.weight.mul_(-1.0)
    _, flipped = run(student, teacher, views, centering)
    assert torch.equal(flipped["loss_cl"], changed["loss_cl"])
    assert (flipped["loss_ibot"] - changed["loss_ibot"]).abs() > 1e-4
