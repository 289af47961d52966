"""Trivial baselines: each fitted on tiny train batches and scored by its task's own metric
against values worked out by hand; the pose template survives the heatmap round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.common.eval_report import TaskEvaluation
from sapiens2.tasks import get_task
from sapiens2.tasks.baselines import TRIVIAL_BASELINES, ClassPrior, ConstantMean, fit_baselines


def make_batch(height: int, width: int, mask: torch.Tensor | None = None, **fields) -> dict:
    """A collated-style batch: blank images (B inferred from the first field) plus `fields`."""
    b = next(iter(fields.values())).shape[0]
    return {
        "id": [f"img{i}" for i in range(b)],
        "image": torch.zeros(b, 3, height, width),
        "image_uint8": torch.zeros(b, height, width, 3, dtype=torch.uint8),
        "mask": torch.ones(b, height, width, dtype=torch.bool) if mask is None else mask,
        **fields,
    }


def scored(task_name: str, prediction, batch: dict) -> dict[str, float]:
    metric = get_task(task_name).metric()
    metric.update(prediction, batch)
    return metric.compute()


def field_map(values: list, height: int, width: int) -> torch.Tensor:
    """(B, 3, H, W) from one RGB/XYZ triple per pixel, listed row-major per image."""
    return torch.tensor(values, dtype=torch.float32).reshape(-1, height, width, 3).permute(0, 3, 1, 2)


def test_every_task_has_baselines_and_fit_needs_labelled_data():
    assert set(TRIVIAL_BASELINES) == {"pose", "seg", "normal", "pointmap", "albedo"}
    assert set(TRIVIAL_BASELINES["albedo"]) == {"constant_mean", "input_image"}
    with pytest.raises(ValueError, match="before fitting"):
        ConstantMean("normal").predict(make_batch(2, 2, normal=torch.zeros(1, 3, 2, 2)))
    with pytest.raises(ValueError, match="no trivial baselines"):
        fit_baselines("depth", get_task("seg"), [])


def test_class_prior_predicts_the_per_pixel_majority_and_scores_its_miou():
    train = torch.tensor([[[1, 1, 2], [0, 255, 3]], [[1, 2, 2], [0, 255, 3]], [[2, 1, 2], [0, 255, 0]]])
    prior = ClassPrior(get_task("seg")).fit([make_batch(2, 3, seg=train[:2]), make_batch(2, 3, seg=train[2:])])
    val = make_batch(2, 3, seg=torch.tensor([[[1, 2, 2], [0, 1, 3]]]))
    logits = prior.predict(val)
    assert logits.shape == (1, 29, 2, 3)
    # (1, 1) is never labelled: it takes the global majority, class 2 (5 pixels vs 4, 4, 2).
    assert logits.argmax(dim=1)[0].tolist() == [[1, 1, 2], [0, 2, 3]]
    r = scored("seg", logits, val)
    # IoU: class 0 1/1, class 1 1/3, class 2 1/3, class 3 1/1; 4 of 6 pixels right.
    assert r["mIoU"] == pytest.approx((1 + 1 / 3 + 1 / 3 + 1) / 4)
    assert r["aAcc"] == pytest.approx(4 / 6)


def test_constant_normal_is_the_renormalised_masked_mean():
    mask = torch.tensor([[[True, True], [True, False]]])
    normals = field_map([[0, 0, 1], [0, 1, 0], [0, 0.5, 0.5], [-1, 0, 0]], 2, 2)
    baseline = fit_baselines("normal", get_task("normal"), [make_batch(2, 2, mask, normal=normals)])["constant_mean"]
    val = make_batch(2, 2, normal=field_map([[0, 0, 1]] * 4, 2, 2))
    pred = baseline.predict(val)
    torch.testing.assert_close(pred[0, :, 1, 1], torch.tensor([0.0, 2**-0.5, 2**-0.5]))
    assert scored("normal", pred, val)["angular_error_mean"] == pytest.approx(45.0, abs=1e-4)


def test_albedo_constant_colour_and_input_image():
    # 6x6 images (SSIM's 11-px window needs 6 for its reflect padding); the unmasked right half
    # is white and must not enter the mean.
    albedo = torch.ones(2, 3, 6, 6)
    albedo[0, :, :, :3] = torch.tensor([0.2, 0.4, 0.6])[:, None, None]
    albedo[1, :, :, :3] = torch.tensor([0.4, 0.4, 0.2])[:, None, None]
    mask = torch.zeros(2, 6, 6, dtype=torch.bool)
    mask[:, :, :3] = True
    fitted = fit_baselines("albedo", get_task("albedo"), [make_batch(6, 6, mask, albedo=albedo)])
    val = make_batch(6, 6, albedo=torch.tensor([0.3, 0.4, 0.5])[None, :, None, None].expand(1, 3, 6, 6))
    val["image_uint8"][:] = 51  # 0.2 in [0, 1]
    constant = scored("albedo", fitted["constant_mean"].predict(val), val)
    assert constant["mae"] == pytest.approx(0.1 / 3) and constant["psnr"] == pytest.approx(10 * np.log10(300))
    identity = scored("albedo", fitted["input_image"].predict(val), val)
    assert identity["mae"] == pytest.approx(0.6 / 3) and identity["psnr"] == pytest.approx(10 * np.log10(3 / 0.14))


def test_mean_canonical_pointmap_scored_by_canonical_and_metric_errors():
    def pinhole(fx: float, n: int) -> torch.Tensor:
        return torch.tensor([[fx, 0, 1.0], [0, fx, 1.0], [0, 0, 1.0]]).expand(n, 3, 3)

    # s_gt = width / fx: 1.0 and 0.5, so both train images have canonical depth 2 or 4.
    train = make_batch(2, 2, torch.tensor([[[True, True], [True, False]], [[True, False], [False, False]]]),
                       pointmap=field_map([[0, 0, 2]] * 4 + [[0, 0, 8]] * 4, 2, 2), K=torch.cat([pinhole(2, 1), pinhole(4, 1)]))
    baseline = fit_baselines("pointmap", get_task("pointmap"), [train])["constant_mean"]
    val = make_batch(2, 2, pointmap=field_map([[0, 0, 2]] * 4, 2, 2), K=pinhole(2, 1))
    pred = baseline.predict(val)
    # Pixel (0, 0) averages 2 and 4; (1, 1) was never masked: mean of all masked pixels (6 + 4) / 4.
    assert pred["canonical"][0, 2].tolist() == [[3.0, 2.0], [2.0, 2.5]]
    assert pred["scale"].tolist() == [0.75]
    r = scored("pointmap", pred, val)
    assert r["canonical_l2_mean"] == pytest.approx((1 + 0 + 0 + 0.5) / 4)
    assert r["l2_mean"] == pytest.approx((4 + 2 * (2 / 0.75) + 2.5 / 0.75) / 4 - 2, rel=1e-6)
    assert r["scale_rel_error"] == pytest.approx(0.25) and r["scale_mae"] == pytest.approx(0.25)


POSE_SIZE = (128, 96)


def pose_batch(boxes: list, keypoints: torch.Tensor) -> dict:
    return make_batch(*POSE_SIZE, keypoints=keypoints, bbox=torch.tensor(boxes, dtype=torch.float32))


def pose_train() -> tuple[dict, torch.Tensor]:
    """Two people whose box-normalised skeletons are known; keypoint 16 is never visible."""
    g = torch.Generator().manual_seed(0)
    uv = 0.1 + 0.8 * torch.rand(2, 17, 2, generator=g)
    boxes = torch.tensor([[10.0, 20.0, 50.0, 100.0], [40.0, 10.0, 90.0, 120.0]])
    xy = boxes[:, None, :2] + uv * (boxes[:, None, 2:] - boxes[:, None, :2])
    visible = torch.ones(2, 17, 1)
    visible[:, 16], visible[1, 3] = 0, 0  # keypoint 3's mean is person 0's alone
    template = torch.where(torch.arange(17)[:, None] == 3, uv[0], uv.mean(dim=0))
    return pose_batch(boxes.tolist(), torch.cat([xy, 2 * visible], dim=-1)), template


def test_pose_template_decodes_back_to_the_box_placed_mean_skeleton():
    task = get_task("pose")
    train, template = pose_train()
    baseline = fit_baselines("pose", task, [train])["mean_skeleton_in_box"]
    box = torch.tensor([[20.0, 15.0, 70.0, 115.0]])
    val = pose_batch(box.tolist(), torch.zeros(1, 17, 3))
    placed = box[:, None, :2] + template * (box[:, None, 2:] - box[:, None, :2])
    torch.testing.assert_close(baseline.keypoints(val)[0, :16, :2], placed[0, :16])
    assert baseline.keypoints(val)[0, :, 2].tolist() == [1.0] * 16 + [0.0]
    heatmaps = baseline.predict(val)
    assert heatmaps.shape == (1, 17, 32, 24)
    decoded = task.codec((32, 24), POSE_SIZE).decode(heatmaps.numpy())
    assert np.abs(decoded[0, :16, :2] - placed[0, :16].numpy()).max() < 0.5
    assert decoded[0, 16, 2] == 0.0  # never visible in training: empty heatmap, zero score


def test_pose_template_scores_coco_ap_by_hand():
    task = get_task("pose")
    train, _ = pose_train()
    baseline = fit_baselines("pose", task, [train])["mean_skeleton_in_box"]
    box = [[20.0, 15.0, 70.0, 115.0]]
    exact = baseline.keypoints(pose_batch(box, torch.zeros(1, 17, 3)))
    exact[..., 2] *= 2
    assert scored("pose", baseline.predict(pose_batch(box, exact)), pose_batch(box, exact))["AP"] == pytest.approx(1.0)
    # Every labelled point 5 px off: OKS = mean_k exp(-d^2 / (2 area (2 sigma_k)^2)); the one
    # detection matches at the COCO thresholds below its OKS, so AP is the fraction of those.
    shifted = exact.clone()
    shifted[0, :16, 0] += 5.0
    sigmas = np.asarray(task.oks_sigmas[:16])
    oks = np.exp(-25.0 / (2 * 50.0 * 100.0 * (2 * sigmas) ** 2)).mean()
    thresholds = np.linspace(0.5, 0.95, 10)
    assert np.abs(thresholds - oks).min() > 0.01  # a decoding error of < 0.5 px cannot cross one
    gt = pose_batch(box, shifted)
    assert scored("pose", baseline.predict(gt), gt)["AP"] == pytest.approx((thresholds < oks).mean())


def test_a_constant_predictor_fails_the_gate():
    """A 'model' that outputs the train-mean normal ties the trivial baseline; one that outputs the
    best constant in hindsight (the val mean) still falls short of the 1-degree margin."""
    task = get_task("normal")
    train_normals = field_map([[0, 0, 1], [0, 0.1, 1]] * 2, 2, 2)
    val = make_batch(2, 2, normal=field_map([[0, 0, 1], [0, 0.12, 1]] * 2, 2, 2))
    trivial = fit_baselines("normal", task, [make_batch(2, 2, normal=train_normals)])
    trivial_scores = {name: scored("normal", b.predict(val), val) for name, b in trivial.items()}
    hindsight = ConstantMean("normal", unit=True).fit([val])
    for model in (trivial["constant_mean"], hindsight):
        evaluation = TaskEvaluation("normal", task.primary_metric, task.higher_is_better,
                                    scored("normal", model.predict(val), val), {task.primary_metric: 90.0}, 1,
                                    trivial=trivial_scores, gate_margin=1.0)
        assert 0 <= evaluation.margin < 1.0 and not evaluation.beats_baseline
