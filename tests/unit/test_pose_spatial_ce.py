"""Pose heatmap losses: the spatial-softmax cross-entropy against the normalised Gaussian, its
heatmaps and decoding, flip test on heatmaps, and the unchanged default MSE."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from sapiens2.tasks import get_task
from sapiens2.tasks.keypoint_codec import flip_heatmaps

H, W = 128, 96  # image; heatmaps are 32x24 at stride 4
HH, HW = H // 4, W // 4
SIGMA = 2.0


pytestmark = pytest.mark.usefixtures("one_thread")


def udp_cells(keypoints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Heatmap-cell coordinates of image keypoints (UDP: first/last pixel centres on first/last cells)."""
    mx = (keypoints[..., 0] - 0.5) * (HW - 1) / (W - 1)
    my = (keypoints[..., 1] - 0.5) * (HH - 1) / (H - 1)
    return mx, my


def log_gaussian(keypoints: np.ndarray) -> np.ndarray:
    """(B, K, HH, HW) log of the target Gaussian, computed in closed form (no log of 0)."""
    mx, my = udp_cells(keypoints)
    xs, ys = np.arange(HW), np.arange(HH)
    dx2 = (xs - mx[..., None]) ** 2
    dy2 = (ys - my[..., None]) ** 2
    return -(dy2[..., :, None] + dx2[..., None, :]) / (2 * SIGMA**2)


def batch_of(keypoints: np.ndarray) -> dict:
    return {"image": torch.zeros(len(keypoints), 3, H, W), "keypoints": torch.from_numpy(keypoints).float()}


# Two people: labelled interior keypoints, one unlabelled (v=0) and one occluded (v=1, still labelled).
KEYPOINTS = np.array(
    [
        [[30.3, 40.7, 2], [60.0, 90.2, 1], [10.0, 10.0, 0]],
        [[48.5, 64.5, 2], [20.9, 100.1, 2], [75.4, 20.6, 2]],
    ],
    np.float32,
)


def hand_spatial_ce(logits: np.ndarray, keypoints: np.ndarray) -> float:
    target = np.exp(log_gaussian(keypoints))
    dist = target.reshape(*target.shape[:2], -1)
    dist = dist / dist.sum(-1, keepdims=True)
    flat = logits.reshape(*logits.shape[:2], -1).astype(np.float64)
    log_probs = flat - flat.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    ce = -(dist * log_probs).sum(-1)
    weight = (keypoints[..., 2] > 0).astype(np.float64)
    return float((ce * weight).sum() / weight.sum())


def test_spatial_ce_matches_a_hand_computation():
    task = get_task("pose", heatmap_loss="spatial_ce")
    logits = np.random.default_rng(0).normal(0, 2, (2, 3, HH, HW)).astype(np.float32)
    loss, parts = task.loss(torch.from_numpy(logits), batch_of(KEYPOINTS))
    expected = hand_spatial_ce(logits, KEYPOINTS)
    assert float(loss) == pytest.approx(expected, rel=1e-4)
    assert parts["spatial_ce"] == pytest.approx(expected, rel=1e-4)
    assert parts["loss"] == pytest.approx(expected, rel=1e-4)


def test_unlabelled_keypoints_do_not_count():
    task = get_task("pose", heatmap_loss="spatial_ce")
    logits = torch.from_numpy(np.random.default_rng(0).normal(0, 2, (2, 3, HH, HW)).astype(np.float32))
    changed = logits.clone()
    changed[0, 2] = torch.randn(HH, HW) * 5  # person 0's keypoint 2 is unlabelled
    base, _ = task.loss(logits, batch_of(KEYPOINTS))
    assert float(task.loss(changed, batch_of(KEYPOINTS))[0]) == pytest.approx(float(base), rel=1e-6)
    changed[0, 1] = torch.randn(HH, HW) * 5  # occluded but labelled: counts
    assert float(task.loss(changed, batch_of(KEYPOINTS))[0]) != pytest.approx(float(base), rel=1e-3)


def test_log_target_beats_a_shifted_prediction():
    task = get_task("pose", heatmap_loss="spatial_ce")
    exact = torch.from_numpy(log_gaussian(KEYPOINTS)).float()
    shifted_keypoints = KEYPOINTS.copy()
    shifted_keypoints[..., 0] += 8.0  # two heatmap cells
    shifted = torch.from_numpy(log_gaussian(shifted_keypoints)).float()
    exact_loss = float(task.loss(exact, batch_of(KEYPOINTS))[0])
    assert exact_loss < float(task.loss(shifted, batch_of(KEYPOINTS))[0])
    # The minimum of a cross-entropy is the target's entropy, reached at softmax = target.
    assert exact_loss == pytest.approx(hand_spatial_ce(log_gaussian(KEYPOINTS), KEYPOINTS), rel=1e-4)


def test_heatmaps_are_the_softmax_scaled_to_a_unit_peak():
    task = get_task("pose", heatmap_loss="spatial_ce")
    logits = torch.from_numpy(log_gaussian(KEYPOINTS)).float()
    heatmaps = task.heatmaps(logits)
    softmax = torch.softmax(logits.flatten(-2), -1).reshape(logits.shape)
    torch.testing.assert_close(heatmaps, softmax * (2 * math.pi * task.sigma**2))
    # A Gaussian well inside the map sums to 2 pi sigma^2, so its peak comes out near 1.
    assert float(heatmaps[1, 0].max()) == pytest.approx(1.0, abs=0.05)


def test_decoding_log_gaussian_logits_recovers_the_keypoints():
    task = get_task("pose", heatmap_loss="spatial_ce")
    rng = np.random.default_rng(0)
    keypoints = np.concatenate(
        [rng.uniform([8, 8], [W - 8, H - 8], (3, 17, 2)), np.full((3, 17, 1), 2.0)], -1
    ).astype(np.float32)
    decoded = np.stack(task.decode(task.heatmaps(torch.from_numpy(log_gaussian(keypoints)).float())))
    assert np.abs(decoded[..., :2] - keypoints[..., :2]).max() <= 0.5


class TwoViews(nn.Module):
    """Returns fixed logits for the given images and other fixed logits for any other input."""

    def __init__(self, images: torch.Tensor, logits: torch.Tensor, flipped_logits: torch.Tensor) -> None:
        super().__init__()
        self.images, self.logits, self.flipped_logits = images, logits, flipped_logits

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits if torch.equal(images, self.images) else self.flipped_logits


def test_flip_test_averages_heatmaps_not_logits():
    task = get_task("pose", heatmap_loss="spatial_ce")
    assert task.flip_test
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(1, 3, H, W, generator=gen)
    logits = torch.randn(1, 17, HH, HW, generator=gen) * 3
    flipped_logits = torch.randn(1, 17, HH, HW, generator=gen) * 3
    got = task.predict(TwoViews(images, logits, flipped_logits), images)
    index = task._flip_index
    expected = 0.5 * (task.heatmaps(logits) + flip_heatmaps(task.heatmaps(flipped_logits), index))
    torch.testing.assert_close(got, expected)
    averaged_logits = task.heatmaps(0.5 * (logits + flip_heatmaps(flipped_logits, index)))
    assert not torch.allclose(got, averaged_logits, atol=1e-3)


def test_default_is_the_weighted_heatmap_mse():
    task = get_task("pose")
    assert task.heatmap_loss == "mse"
    pred = torch.from_numpy(np.random.default_rng(0).normal(0, 0.3, (2, 3, HH, HW)).astype(np.float32))
    loss, parts = task.loss(pred, batch_of(KEYPOINTS))
    target = np.exp(log_gaussian(KEYPOINTS))
    weight = (KEYPOINTS[..., 2] > 0).astype(np.float64)[..., None, None]
    mse = float(((pred.numpy() - target) ** 2 * weight).mean())
    assert parts["heatmap_mse"] == pytest.approx(mse, rel=1e-4)
    assert float(loss) == pytest.approx(task.heatmap_mse_weight * mse, rel=1e-4)
    assert set(parts) == {"heatmap_mse", "loss"}
    torch.testing.assert_close(task.heatmaps(pred), pred)  # mse heatmaps are the output itself
