"""Albedo: MAE/RMSE/PSNR from sums, masked SSIM, exact merge, loss terms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sapiens2.tasks import get_task
from sapiens2.tasks.albedo import ssim_map


def albedo_batch(b: int = 2, h: int = 16, w: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, h, w, dtype=torch.bool)
    mask[:, 2:14, 3:9] = True
    albedo = (0.2 + 0.6 * torch.rand(b, 3, h, w, generator=g)) * mask[:, None]
    return {"albedo": albedo, "mask": mask}


def test_metric_on_a_known_offset():
    batch = albedo_batch()
    pred = batch["albedo"] + 0.1 * batch["mask"][:, None]  # +0.1 on the person only
    pred[:, :, 0, 0] = 0.9  # background errors must not count
    metric = get_task("albedo").metric()
    metric.update(pred, batch)
    r = metric.compute()
    assert r["mae"] == pytest.approx(0.1, rel=1e-6) and r["rmse"] == pytest.approx(0.1, rel=1e-6)
    assert r["psnr"] == pytest.approx(20.0, rel=1e-6)
    assert 0.0 < r["ssim"] < 1.0


def test_ssim_is_one_for_identical_images_and_drops_with_noise():
    batch = albedo_batch()
    metric = get_task("albedo").metric()
    metric.update(batch["albedo"].clone(), batch)
    assert metric.compute()["ssim"] == pytest.approx(1.0, abs=1e-9)
    g = torch.Generator().manual_seed(1)
    noisy = batch["albedo"] + 0.2 * torch.randn(batch["albedo"].shape, generator=g)
    assert ssim_map(noisy.clamp(0, 1).double(), batch["albedo"].double()).mean() < 0.9
    # Flat images have no contrast or structure term: SSIM = (2ab + C1) / (a^2 + b^2 + C1).
    flat = ssim_map(
        torch.full((1, 3, 16, 16), 0.5, dtype=torch.float64),
        torch.full((1, 3, 16, 16), 0.3, dtype=torch.float64),
    )
    torch.testing.assert_close(flat, torch.full_like(flat, (0.3 + 1e-4) / (0.34 + 1e-4)))


def test_ssim_map_matches_scikit_image_away_from_the_border():
    # scikit-image's Gaussian SSIM (sigma 1.5, truncated to the same 11 taps, population
    # covariance) as the reference; its border handling differs, so compare the interior.
    from skimage.metrics import structural_similarity

    g = torch.Generator().manual_seed(3)
    target = torch.rand(2, 3, 32, 24, generator=g, dtype=torch.float64)
    pred = (target + 0.15 * torch.randn(target.shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    ours = ssim_map(pred, target)
    for i in range(2):
        _, full = structural_similarity(pred[i].numpy(), target[i].numpy(), channel_axis=0, data_range=1.0,
                                        gaussian_weights=True, sigma=1.5, use_sample_covariance=False, full=True)
        np.testing.assert_allclose(ours[i, 5:-5, 5:-5].numpy(), full.mean(axis=0)[5:-5, 5:-5], atol=1e-10)


def test_merge_of_two_halves_equals_the_whole():
    batch = albedo_batch(b=4)
    g = torch.Generator().manual_seed(2)
    pred = batch["albedo"] + 0.05 * torch.randn(batch["albedo"].shape, generator=g)
    task = get_task("albedo")
    whole, first, second = task.metric(), task.metric(), task.metric()
    whole.update(pred, batch)
    first.update(pred[:2], {k: v[:2] for k, v in batch.items()})
    second.update(pred[2:], {k: v[2:] for k, v in batch.items()})
    assert first.merge(second).compute() == pytest.approx(whole.compute(), rel=1e-12)


def test_loss_terms():
    task = get_task("albedo")
    batch = albedo_batch()
    _, perfect = task.loss(batch["albedo"].clone(), batch)
    assert perfect["loss"] == pytest.approx(0.0, abs=1e-6)
    # Doubling the intensity keeps the chromaticity (up to its epsilon) but not the colour values.
    _, brighter = task.loss(batch["albedo"] * 2, batch)
    assert brighter["chromaticity_l1"] < 1e-3 < brighter["albedo_l1"]
    shifted = batch["albedo"] + 0.1  # a constant offset has no gradient
    loss, log = task.loss(shifted, batch)
    assert log["albedo_l1"] == pytest.approx(0.1, rel=1e-5) and log["albedo_gradient_l1"] < 1e-6
    assert loss.item() == pytest.approx(
        2 * log["albedo_l1"] + 2 * log["albedo_gradient_l1"] + log["chromaticity_l1"], rel=1e-6
    )


def test_decode_and_visualize_clip_to_valid_range():
    task = get_task("albedo")
    out = task.decode(torch.tensor([[[[-0.5, 0.5, 1.5]]] * 3]))[0]
    assert out.shape == (1, 3, 3) and out.min() == 0.0 and out.max() == 1.0
    assert task.visualize(np.zeros((1, 3, 3), np.uint8), out)[0, :, 0].tolist() == [0, 128, 255]
