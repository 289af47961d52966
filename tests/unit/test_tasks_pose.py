"""Pose: UDP codec round trip, flip test, loss weighting and OKS AP against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sapiens2.tasks import get_task
from sapiens2.tasks.keypoint_codec import (
    UDPHeatmapCodec,
    dark_blur_kernel_size,
    flip_heatmaps,
    flip_index,
)
from sapiens2.labels import COCO_FLIP_PAIRS, COCO_OKS_SIGMAS


def random_keypoints(n: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Keypoints anywhere between the first and last pixel centres, all visible."""
    g = torch.Generator().manual_seed(seed)
    xy = (
        torch.rand(n, 17, 2, generator=g, dtype=torch.float64)
        * torch.tensor([width - 1.0, height - 1.0])
        + 0.5
    )
    return torch.cat([xy, torch.full((n, 17, 1), 2.0, dtype=torch.float64)], -1).float()


@pytest.mark.parametrize(
    "input_size,heatmap_size,sigma",
    [
        ((256, 192), (64, 48), 2.0),  # MMPose's standard setting
        ((1024, 768), (256, 192), 6.0),  # the reference Sapiens2 codec
        ((128, 96), (32, 24), 2.0),  # the demo
    ],
)
def test_codec_round_trip_within_half_a_pixel(input_size, heatmap_size, sigma):
    codec = UDPHeatmapCodec(input_size, heatmap_size, sigma)
    keypoints = random_keypoints(8, *input_size, seed=1)
    heatmaps, weights = codec.encode(keypoints)
    assert heatmaps.shape == (8, 17, *heatmap_size) and bool((weights == 1).all())
    decoded = codec.decode(heatmaps.numpy())
    error = np.abs(decoded[..., :2] - keypoints[..., :2].numpy())
    assert error.max() < 0.5
    # Argmax alone would be off by up to half a heatmap cell (2 or 4 image pixels): DARK matters.
    assert np.abs(decoded[..., 2] - heatmaps.amax(dim=(-1, -2)).numpy()).max() < 1e-6


def test_codec_weights_and_blur_kernel():
    codec = UDPHeatmapCodec((256, 192), (64, 48), 2.0)
    kpts = torch.tensor(
        [[[100.0, 100.0, 0.0], [100.0, 100.0, 1.0], [-200.0, 50.0, 2.0], [0.5, 0.5, 2.0]]]
    )
    heatmaps, weights = codec.encode(kpts)
    assert weights.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert heatmaps[0, 0].abs().max() == 0 and heatmaps[0, 3, 0, 0] == pytest.approx(1.0)
    assert dark_blur_kernel_size(2.0) == 11 and dark_blur_kernel_size(6.0) % 2 == 1


def test_flipped_heatmaps_map_back_exactly():
    codec = UDPHeatmapCodec((128, 96), (32, 24), 2.0)
    kpts = random_keypoints(3, 128, 96, seed=2)
    mirrored = kpts.clone()
    mirrored[..., 0] = 96 - kpts[..., 0]
    index = flip_index(17, COCO_FLIP_PAIRS)
    mirrored = mirrored[:, index]
    torch.testing.assert_close(
        flip_heatmaps(codec.encode(mirrored)[0], index), codec.encode(kpts)[0], atol=1e-6, rtol=0
    )


class MirrorSymmetricPoseModel(nn.Module):
    """Heatmaps of a left/right symmetric pose, scaled by the image mean: mirror-consistent."""

    def __init__(self, codec: UDPHeatmapCodec, pose: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("heatmaps", codec.encode(pose[None])[0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.heatmaps * images.mean(dim=(1, 2, 3))[:, None, None, None].abs()


def test_flip_test_is_a_no_op_for_symmetric_input_and_model():
    task = get_task("pose")
    codec = task.codec((32, 24))
    x_left = torch.linspace(20, 40, 17)
    pose = torch.stack([x_left, torch.linspace(10, 120, 17), torch.full((17,), 2.0)], -1)
    for left, right in COCO_FLIP_PAIRS:
        pose[right, 0] = 96 - pose[left, 0]
        pose[right, 1] = pose[left, 1]
    pose[0, 0] = 48.0  # the nose sits on the mirror axis
    model = MirrorSymmetricPoseModel(codec, pose)
    half = torch.rand(2, 3, 128, 48)
    images = torch.cat([half, half.flip(-1)], -1)  # mirror-symmetric input
    torch.testing.assert_close(task.predict(model, images), model(images), atol=1e-6, rtol=0)
    # An asymmetric pose is not mirror-consistent, so the flip test must change its heatmaps.
    skewed = MirrorSymmetricPoseModel(codec, pose + torch.tensor([5.0, 0.0, 0.0]))
    assert not torch.allclose(task.predict(skewed, images), skewed(images), atol=1e-3)
    no_flip = get_task("pose", flip_test=False)
    torch.testing.assert_close(no_flip.predict(skewed, images), skewed(images))


def test_loss_is_zero_on_targets_and_ignores_unlabelled_keypoints():
    task = get_task("pose")
    kpts = random_keypoints(2, 128, 96, seed=3)
    kpts[0, 4, 2] = 0.0
    batch = {"image": torch.zeros(2, 3, 128, 96), "keypoints": kpts}
    target, _ = task.codec((32, 24)).encode(kpts)
    loss, log = task.loss(target.clone(), batch)
    assert loss.item() == 0.0 and log["heatmap_mse"] == 0.0
    noisy = target.clone()
    noisy[0, 4] = 1.0  # an unlabelled keypoint: any prediction is free
    assert task.loss(noisy, batch)[0].item() == 0.0
    noisy[0, 5] += 0.5  # a labelled one: 10 x mean of squared errors over all cells
    expected = 10 * (0.25 * 32 * 24) / noisy.numel()
    assert task.loss(noisy, batch)[0].item() == pytest.approx(expected, rel=1e-5)


def oks_by_hand(gt: np.ndarray, dt: np.ndarray, area: float) -> float:
    """OKS as defined by COCO: mean over labelled keypoints of exp(-d^2 / (2 s^2 k^2))."""
    k2 = (2 * np.asarray(COCO_OKS_SIGMAS)) ** 2
    d2 = ((gt[:, :2] - dt[:, :2]) ** 2).sum(-1)
    labelled = gt[:, 2] > 0
    return float(np.exp(-d2 / k2 / area / 2)[labelled].mean())


def pose_batch(keypoints: torch.Tensor, ids: list[str]) -> dict:
    bbox = torch.tensor([40.0, 30.0, 150.0, 230.0]).expand(len(ids), 4)
    return {
        "image": torch.zeros(len(ids), 3, 256, 192),
        "keypoints": keypoints,
        "bbox": bbox,
        "id": ids,
    }


def test_oks_ap_is_one_for_perfect_predictions():
    task = get_task("pose")
    kpts = random_keypoints(3, 256, 192, seed=4)
    kpts[1, :3, 2] = 0.0  # unlabelled keypoints are not scored
    metric = task.metric()
    metric.update(
        task.codec((64, 48), (256, 192)).encode(kpts)[0], pose_batch(kpts, ["a", "b", "c"])
    )
    result = metric.compute()
    assert result["AP"] == pytest.approx(1.0) and result["AR"] == pytest.approx(1.0)


def test_oks_ap_for_displaced_predictions_matches_hand_computation():
    task = get_task("pose")
    codec = task.codec((64, 48), (256, 192))
    gt = random_keypoints(1, 256, 192, seed=5)
    gt[..., :2] = gt[..., :2] * 0.5 + 60  # keep the person inside the image after displacement
    shift = torch.tensor([7.0, -5.0])  # OKS 0.835: passes 7 of the 10 thresholds, AP 0.7
    dt = gt.clone()
    dt[..., :2] += shift
    area = 110.0 * 200.0
    oks = oks_by_hand(gt[0].numpy(), dt[0].numpy(), area)
    assert 0.55 < oks < 0.95 and min(abs(oks - t) for t in np.arange(0.5, 1.0, 0.05)) > 0.005
    # One detection per image: at threshold t it is a true positive (precision 1 at recall 1)
    # when OKS >= t, else recall stays 0; AP is the fraction of the ten thresholds passed.
    expected_ap = float(np.mean(oks >= np.linspace(0.5, 0.95, 10)))
    assert expected_ap == pytest.approx(0.7)
    metric = task.metric()
    metric.update(codec.encode(dt)[0], pose_batch(gt, ["x"]))
    result = metric.compute()
    assert result["AP"] == pytest.approx(expected_ap, abs=1e-9)
    assert 0.0 < result["AP"] < 1.0
    assert result["AP50"] == pytest.approx(1.0) and result["AP75"] == pytest.approx(
        float(oks >= 0.75)
    )


def test_oks_metric_merge_of_two_halves_equals_the_whole():
    task = get_task("pose")
    codec = task.codec((64, 48), (256, 192))
    gt = random_keypoints(6, 256, 192, seed=6)
    gen = torch.Generator().manual_seed(7)
    dt = gt.clone()
    dt[..., :2] += torch.randn(6, 17, 2, generator=gen) * 4
    heatmaps = codec.encode(dt)[0]
    ids = [f"{i:03d}" for i in range(6)]
    whole = task.metric()
    whole.update(heatmaps, pose_batch(gt, ids))
    first, second = task.metric(), task.metric()
    second.update(heatmaps[3:], pose_batch(gt[3:], ids[3:]))  # order does not matter
    first.update(heatmaps[:3], pose_batch(gt[:3], ids[:3]))
    restored = task.metric()
    restored.load_state_dict(first.state_dict())
    assert restored.merge(second).compute() == whole.compute()


def test_visualize_draws_the_skeleton():
    task = get_task("pose")
    kpts = random_keypoints(1, 128, 96, seed=8)[0].numpy()
    kpts[:, 2] = 0.9
    image = np.zeros((128, 96, 3), np.uint8)
    picture = task.visualize(image, kpts)
    assert picture.shape == image.shape and picture.dtype == np.uint8 and picture.any()
    assert not image.any()  # drawn on a copy
