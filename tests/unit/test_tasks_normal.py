"""Normal: angular-error statistics on known vectors, exact merge, loss terms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sapiens2.tasks import get_task
from sapiens2.tasks.angular import BIN_WIDTH_DEG


def rotated_normals(angles_deg: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 3, 1, N) ground truth facing the camera and predictions rotated about y by each angle."""
    a = torch.deg2rad(torch.tensor(angles_deg, dtype=torch.float64))
    gt = torch.stack([torch.zeros_like(a), torch.zeros_like(a), -torch.ones_like(a)])
    pred = torch.stack([torch.sin(a), torch.zeros_like(a), -torch.cos(a)])
    return pred[None, :, None].float(), gt[None, :, None].float()


def normal_batch(gt: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    if mask is None:
        mask = torch.ones(gt.shape[0], *gt.shape[2:], dtype=torch.bool)
    return {"normal": gt, "mask": mask}


def test_angular_error_statistics_on_known_vectors():
    angles = [0.0, 10.0, 20.0, 40.0, 50.0, 123.0]
    pred, gt = rotated_normals(angles)
    mask = torch.ones(1, 1, 6, dtype=torch.bool)
    mask[0, 0, 5] = False  # the 123-degree pixel is background
    metric = get_task("normal").metric()
    metric.update(pred * 3.0, normal_batch(gt, mask))  # magnitude must not matter
    r = metric.compute()
    used = np.array(angles[:5])
    assert r["angular_error_mean"] == pytest.approx(used.mean(), abs=1e-4)
    assert r["angular_error_median"] == pytest.approx(20.0, abs=BIN_WIDTH_DEG)
    assert r["angular_error_rmse"] == pytest.approx(math.sqrt((used**2).mean()), abs=1e-4)
    assert (
        r["angular_error_within_5deg"],
        r["angular_error_within_11.25deg"],
        r["angular_error_within_22.5deg"],
        r["angular_error_within_30deg"],
    ) == (0.2, 0.4, 0.6, 0.6)


def test_median_is_exact_to_the_bin_width_on_many_values():
    g = torch.Generator().manual_seed(0)
    angles = (torch.rand(1001, generator=g, dtype=torch.float64) * 90).tolist()
    pred, gt = rotated_normals(angles)
    metric = get_task("normal").metric()
    metric.update(pred, normal_batch(gt))
    assert metric.compute()["angular_error_median"] == pytest.approx(
        np.median(angles), abs=BIN_WIDTH_DEG
    )


def test_merge_of_two_halves_equals_the_whole():
    g = torch.Generator().manual_seed(1)
    pred = torch.randn(4, 3, 8, 6, generator=g)
    gt = torch.nn.functional.normalize(torch.randn(4, 3, 8, 6, generator=g), dim=1)
    mask = torch.rand(4, 8, 6, generator=g) > 0.3
    task = get_task("normal")
    whole, first, second = task.metric(), task.metric(), task.metric()
    whole.update(pred, normal_batch(gt, mask))
    first.update(pred[:2], normal_batch(gt[:2], mask[:2]))
    second.update(pred[2:], normal_batch(gt[2:], mask[2:]))
    merged = first.merge(second)
    for key, value in whole.state_dict().items():
        np.testing.assert_allclose(merged.state_dict()[key], value, rtol=1e-12)
    assert merged.compute() == pytest.approx(whole.compute(), rel=1e-12)


def test_loss_terms():
    task = get_task("normal")
    pred, gt = rotated_normals([0.0, 0.0, 90.0, 0.0])
    mask = torch.ones(1, 1, 4, dtype=torch.bool)
    _, perfect = task.loss(gt * 2, normal_batch(gt, mask))  # scale-free: it is normalised first
    assert perfect["loss"] == pytest.approx(0.0, abs=1e-6)
    loss, log = task.loss(pred, normal_batch(gt, mask))
    assert log["cosine_distance"] == pytest.approx(1 / 4, abs=1e-6)  # one pixel at 90 degrees
    assert log["normal_l1"] == pytest.approx(2 / 12, abs=1e-6)  # |1-0| + |0-(-1)| over 12 values
    # Horizontal differences: two of the three pairs touch the rotated pixel.
    assert log["normal_gradient_l1"] == pytest.approx((2 * 2 / 9) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(
        10 * log["cosine_distance"] + log["normal_l1"] + 10 * log["normal_gradient_l1"], rel=1e-6
    )
    mask[0, 0, 2] = False  # masking out the wrong pixel removes every error
    assert task.loss(pred, normal_batch(gt, mask))[0].item() == pytest.approx(0.0, abs=1e-6)


def test_visualize_colours():
    task = get_task("normal")
    out = task.visualize(
        np.zeros((1, 2, 3), np.uint8), np.array([[[0, 0, 1], [-1, 0, 0]]], np.float32)
    )
    assert out.tolist() == [[[128, 128, 255], [0, 128, 128]]]
