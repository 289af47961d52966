"""Pointmap: metric-space errors on known offsets, canonical/scale loss, derived normals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sapiens2.tasks import get_task
from sapiens2.tasks.pointmap import normals_from_pointmap

H, W = 8, 6


def plane_batch(b: int = 2, fx: float = 12.0) -> dict:
    """A tilted plane in front of a pinhole camera, all pixels on the mask."""
    yy, xx = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    z = (2.0 + 0.05 * xx + 0.02 * yy).expand(b, H, W) + 0.5 * torch.arange(b)[:, None, None]
    points = torch.stack([(xx - W / 2) * z / fx, (yy - H / 2) * z / fx, z], 1)
    K = torch.tensor([[fx, 0, W / 2], [0, fx, H / 2], [0, 0, 1.0]]).expand(b, 3, 3)
    return {
        "image": torch.zeros(b, 3, H, W),
        "pointmap": points,
        "K": K,
        "mask": torch.ones(b, H, W, dtype=torch.bool),
    }


def prediction_for(points: torch.Tensor, scale: torch.Tensor) -> dict:
    return {"pointmap": points, "canonical": points * scale[:, None, None, None], "scale": scale}


def test_metric_on_known_offsets():
    batch = plane_batch(b=1)
    batch["mask"][:] = False
    batch["mask"][0, 0, :4] = True
    offsets = torch.tensor(
        [[0.03, 0.0, 0.0], [0.0, -0.08, 0.0], [0.09, 0.0, 0.12], [0.0, 0.0, -0.3]]
    )
    pred = batch["pointmap"].clone()
    pred[0, :, 0, :4] += offsets.T
    metric = get_task("pointmap").metric()
    s_gt = torch.tensor([W / 12.0])
    metric.update(prediction_for(pred, s_gt + 0.1), batch)
    r = metric.compute()
    dist = np.array([0.03, 0.08, 0.15, 0.3])
    assert r["l2_mean"] == pytest.approx(dist.mean())
    # The canonical map is compared at s_gt: the metric error scaled by s_gt, plus the error of
    # the predicted (metric x (s_gt + 0.1)) against the truth (metric x s_gt) at each pixel.
    points = batch["pointmap"][0, :, 0, :4].T.double()
    canonical_error = (pred[0, :, 0, :4].T.double() * (s_gt + 0.1) - points * s_gt).norm(dim=1)
    assert r["canonical_l2_mean"] == pytest.approx(canonical_error.mean().item())
    assert r["rmse"] == pytest.approx(np.sqrt((dist**2).mean()))
    assert (r["mae_x"], r["mae_y"], r["mae_z"]) == pytest.approx((0.12 / 4, 0.08 / 4, 0.42 / 4))
    assert (r["within_5cm"], r["within_10cm"], r["within_20cm"]) == (0.25, 0.5, 0.75)
    assert r["scale_mae"] == pytest.approx(0.1, abs=1e-6)
    assert r["scale_rel_error"] == pytest.approx(0.1 / (W / 12.0), rel=1e-6)


def test_canonical_error_ignores_the_scale_the_image_cannot_tell():
    """A right canonical map with a wrong scale has zero canonical error, only scale error."""
    batch = plane_batch(b=2)
    s_gt = W / batch["K"][:, 0, 0]
    canonical = batch["pointmap"] * s_gt[:, None, None, None]
    wrong_scale = s_gt * torch.tensor([2.0, 0.5])
    pred = {"pointmap": canonical / wrong_scale[:, None, None, None], "canonical": canonical, "scale": wrong_scale}
    metric = get_task("pointmap").metric()
    metric.update(pred, batch)
    r = metric.compute()
    assert r["canonical_l2_mean"] == pytest.approx(0.0, abs=1e-6)
    assert r["scale_rel_error"] == pytest.approx((1.0 + 0.5) / 2)
    assert r["l2_mean"] > 0.5 and r["within_20cm"] < 1.0
    task = get_task("pointmap")
    assert (task.primary_metric, task.higher_is_better) == ("canonical_l2_mean", False)


def test_merge_of_two_halves_equals_the_whole_and_perfect_is_zero():
    batch = plane_batch(b=4)
    g = torch.Generator().manual_seed(0)
    pred = batch["pointmap"] + 0.05 * torch.randn(4, 3, H, W, generator=g)
    scale = torch.full((4,), 0.5)
    task = get_task("pointmap")
    whole, first, second = task.metric(), task.metric(), task.metric()
    whole.update(prediction_for(pred, scale), batch)
    half = lambda d, sl: {k: v[sl] for k, v in d.items()}  # noqa: E731
    first.update(prediction_for(pred[:2], scale[:2]), half(batch, slice(0, 2)))
    second.update(prediction_for(pred[2:], scale[2:]), half(batch, slice(2, 4)))
    assert first.merge(second).compute() == pytest.approx(whole.compute(), rel=1e-12)
    perfect = task.metric()
    perfect.update(prediction_for(batch["pointmap"], torch.full((4,), W / 12.0)), batch)
    r = perfect.compute()
    assert r["l2_mean"] == pytest.approx(0.0, abs=1e-6) and r["within_5cm"] == 1.0
    assert r["canonical_l2_mean"] == pytest.approx(0.0, abs=1e-6) and r["scale_rel_error"] < 1e-6
    assert r["derived_normal_angular_error_mean"] < 0.05 and r["scale_mae"] < 1e-6


def test_loss_is_zero_for_the_canonical_target_and_scale():
    task = get_task("pointmap")
    batch = plane_batch()
    s_gt = W / batch["K"][:, 0, 0]  # f_canonical = image width at the reference ratio
    _, log = task.loss(prediction_for(batch["pointmap"], s_gt), batch)
    assert log["loss"] == pytest.approx(0.0, abs=1e-5)
    _, off = task.loss(prediction_for(batch["pointmap"], s_gt * 1.2), batch)
    assert off["scale_l1"] == pytest.approx(0.2 * s_gt.mean().item(), rel=1e-5)
    assert off["canonical_l1"] > 0
    # Eigen's log loss with lambda 0.5 keeps half the cost of a global scale: (1 - 0.5) log(1.2)^2.
    assert off["depth_silog"] == pytest.approx(0.5 * np.log(1.2) ** 2, rel=1e-4)
    assert off["normal_cosine_distance"] < 1e-6  # normals do not change with scale


def test_normals_from_pointmap_face_the_camera():
    batch = plane_batch(b=1)
    flat = batch["pointmap"].clone()
    flat[:, 2] = 3.0
    normals, valid = normals_from_pointmap(flat, batch["mask"])
    unit = torch.nn.functional.normalize(normals, dim=1)
    assert bool(valid.all()) and valid.shape == (1, H - 1, W - 1)
    torch.testing.assert_close(
        unit, torch.tensor([0.0, 0.0, -1.0])[None, :, None, None].expand_as(unit)
    )


def test_visualize_depth_colours_near_differs_from_far():
    task = get_task("pointmap")
    points = np.zeros((4, 4, 3), np.float32)
    points[:2, :, 2] = 1.0
    points[2:3, :, 2] = 5.0
    picture = task.visualize(np.zeros((4, 4, 3), np.uint8), points)
    assert picture.dtype == np.uint8 and (picture[3] == 0).all()
    assert not (picture[0, 0] == picture[2, 0]).all()


def _plane_samples(n: int = 3) -> list[dict]:
    """Per-sample (dataset-layout) versions of `plane_batch`'s images."""
    batch = plane_batch(b=n)
    return [{"id": f"plane{i}", "image": np.zeros((H, W, 3), np.uint8), "pointmap": batch["pointmap"][i].permute(1, 2, 0).numpy(),
             "K": batch["K"][i].numpy(), "mask": batch["mask"][i].numpy()} for i in range(n)]


def test_the_small_head_starts_from_the_train_mean_canonical_map():
    from sapiens2.model import build_backbone
    from sapiens2.tasks import build_task_model
    from sapiens2.tasks.baselines import fit_baselines

    samples = _plane_samples()
    task = get_task("pointmap").with_label_statistics(iter(samples))
    batch = plane_batch(b=3)
    mean_map = fit_baselines("pointmap", get_task("pointmap"), [batch])["constant_mean"].canonical()
    torch.testing.assert_close(task.canonical_prior, mean_map)
    torch.manual_seed(0)
    model = build_task_model("pointmap", build_backbone("sapiens2_debug", img_size=(128, 96))).eval()
    images = torch.randn(2, 3, 128, 96)
    with torch.no_grad():
        untrained = model(images)["canonical"]
        task.initialise_head(model.head)
        fitted = model(images)["canonical"]
    assert float(untrained.abs().max()) == 0.0  # nothing fitted: no prior, zero residual and offset
    # A fresh head predicts the prior: the mean map, resampled to the head's grid and back, the
    # same for every image (its residual and offset start at zero).
    expected = torch.nn.functional.interpolate(mean_map[None], size=(128, 96), mode="bilinear")
    assert torch.allclose(fitted[0], fitted[1])
    assert float((fitted[0] - expected[0]).abs().mean()) < 0.02 * float(expected[0, 2].mean())


def test_silhouette_offset_learns_depth_from_the_silhouette_height():
    """Canonical depth of a framed person goes as 1 / their pixel height: the offset branch must
    find it from silhouettes alone (a branch blind to the extent stays at the mean)."""
    from sapiens2.tasks.silhouette_depth import SilhouetteOffset

    rng = np.random.default_rng(0)
    heights = rng.uniform(0.55, 0.95, 256)
    silhouettes = torch.zeros(256, 128, 96)
    for i, h in enumerate(heights):
        top = int(rng.integers(0, int(128 * (1 - h)) + 1))
        left = int(rng.integers(20, 60))
        silhouettes[i, top:top + int(128 * h), left:left + 16] = 1.0
    depth = torch.tensor(1.4 / heights, dtype=torch.float32)
    torch.manual_seed(0)
    branch = SilhouetteOffset()
    optimizer = torch.optim.Adam(branch.parameters(), lr=3e-3)
    for _ in range(300):
        loss = (branch(silhouettes[:192])[:, 2] - depth[:192]).abs().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        held_out = (branch(silhouettes[192:])[:, 2] - depth[192:]).abs().mean()
    spread = (depth[192:] - depth[:192].mean()).abs().mean()
    assert float(held_out) < 0.25 * float(spread)


def test_the_silhouette_enters_the_loss_when_the_head_predicts_one():
    batch = plane_batch()
    batch["mask"][:, :, :3] = False
    s_gt = torch.full((2,), W / 12.0)
    pred = prediction_for(batch["pointmap"], s_gt)
    task = get_task("pointmap")
    right = task.loss({**pred, "silhouette_logit": 20.0 * (batch["mask"].float() - 0.5)}, batch)[1]
    wrong = task.loss({**pred, "silhouette_logit": -20.0 * (batch["mask"].float() - 0.5)}, batch)[1]
    assert right["silhouette_bce"] < 1e-3 < 1.0 < wrong["silhouette_bce"]
    assert "silhouette_bce" not in task.loss(pred, batch)[1]


def test_silhouette_pos_weight_charges_missed_person_pixels_more():
    """A silhouette that calls everything background costs pos_weight x more on the person
    pixels; one that calls everything person is charged as before (the background term)."""
    import dataclasses

    batch = plane_batch()
    batch["mask"][:, :, :3] = False
    pred = prediction_for(batch["pointmap"], torch.full((2,), W / 12.0))
    task = get_task("pointmap")
    weighted = dataclasses.replace(task, silhouette_pos_weight=3.0)

    def bce(t, sign: float) -> float:
        logit = torch.full(batch["mask"].shape, sign * 20.0)
        return float(t.loss({**pred, "silhouette_logit": logit}, batch)[1]["silhouette_bce"])

    assert bce(weighted, -1.0) == pytest.approx(3.0 * bce(task, -1.0), rel=1e-4)
    assert bce(weighted, 1.0) == pytest.approx(bce(task, 1.0), rel=1e-4)


def test_decoded_points_off_the_predicted_silhouette_are_zero():
    batch = plane_batch(b=1)
    pred = prediction_for(batch["pointmap"], torch.full((1,), W / 12.0))
    logit = torch.full((1, H, W), -3.0)
    logit[:, 2:5, 1:4] = 3.0
    decoded = get_task("pointmap").decode({**pred, "silhouette_logit": logit})[0]
    on = (logit[0] > 0).numpy()
    np.testing.assert_allclose(decoded[on], batch["pointmap"][0].permute(1, 2, 0).numpy()[on])
    assert not decoded[~on].any()
    assert get_task("pointmap").decode(pred)[0].all()  # no silhouette: every point kept
