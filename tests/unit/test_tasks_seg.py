"""Segmentation: confusion-matrix metric against a hand-computed example, loss terms, flip map."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from sapiens2.tasks import get_task
from sapiens2.tasks.losses import softmax_dice_loss
from sapiens2.labels import SEG_CLASSES, SEG_FLIP
from sapiens2.tasks.seg import ConfusionMetric, inverse_sqrt_frequency

NAMES = ("bg", "a", "b", "c", "d")


def one_hot_logits(pred: torch.Tensor, num_classes: int) -> torch.Tensor:
    return F.one_hot(pred, num_classes).permute(0, 3, 1, 2).float() * 10


def seg_batch(gt: torch.Tensor) -> dict:
    return {"seg": gt}


def test_confusion_metric_matches_hand_computation():
    # (gt, pred) pairs: (0,0) (0,1) (1,1) (1,1) (1,4) | (2,2) (2,0) (1,1); the 255 is ignored.
    gt = torch.tensor([[[0, 0, 1, 1, 1], [2, 2, 1, 255, 255]]])
    pred = torch.tensor([[[0, 1, 1, 1, 4], [2, 0, 1, 2, 3]]])
    metric = ConfusionMetric(NAMES)
    metric.update(one_hot_logits(pred, 5), seg_batch(gt))
    expected = np.zeros((5, 5), np.int64)
    for g, p in [(0, 0), (0, 1), (1, 1), (1, 1), (1, 4), (2, 2), (2, 0), (1, 1)]:
        expected[g, p] += 1
    np.testing.assert_array_equal(metric.state_dict()["confusion"], expected)
    result = metric.compute()
    # IoU: bg 1/3, a 3/5, b 1/2, d 0 (predicted only); c appears only under 255 and is left out.
    assert result["mIoU"] == pytest.approx((1 / 3 + 3 / 5 + 1 / 2 + 0) / 4)
    # Accuracy per ground-truth class: bg 1/2, a 3/4, b 1/2; d has no ground truth.
    assert result["mAcc"] == pytest.approx((1 / 2 + 3 / 4 + 1 / 2) / 3)
    assert result["aAcc"] == pytest.approx(5 / 8)
    assert "IoU.c" not in result and result["IoU.d"] == 0.0


def test_confusion_metric_merge_of_two_halves_equals_the_whole():
    g = torch.Generator().manual_seed(0)
    gt = torch.randint(0, 29, (4, 16, 12), generator=g)
    logits = torch.randn(4, 29, 16, 12, generator=g)
    task = get_task("seg")
    whole, first, second = task.metric(), task.metric(), task.metric()
    whole.update(logits, seg_batch(gt))
    first.update(logits[:2], seg_batch(gt[:2]))
    second.update(logits[2:], seg_batch(gt[2:]))
    assert first.merge(second).compute() == whole.compute()


def test_dice_matches_hand_computation_and_excludes_background():
    target = torch.tensor([[[0, 0, 1, 2], [1, 1, 0, 255]]])
    logits = torch.zeros(1, 3, 2, 4)  # uniform: every probability is 1/3
    n_valid = 7
    dice = [(2 * n_c / 3 + 1) / (n_valid / 3 + n_c + 1) for n_c in (3, 1)]  # classes 1 and 2
    expected = float(np.mean([1 - d for d in dice]))
    assert softmax_dice_loss(logits, target, 255).item() == pytest.approx(expected, rel=1e-6)


def test_dice_and_its_gradient_match_the_one_hot_formula():
    """The textbook formula written out here (softmax times a one-hot mask, summed per class) as
    the oracle for the loss's gather form: ignored pixels out of both sums and without gradient,
    classes absent from the labels kept in the mean."""
    g = torch.Generator().manual_seed(2)
    target = torch.randint(0, 6, (3, 9, 7), generator=g)  # classes 6 and 7 never labelled
    target[0, :2] = 255
    target[2, 4, 1:5] = 255
    logits = (torch.randn(3, 8, 9, 7, generator=g, dtype=torch.float64) * 3).requires_grad_(True)

    def one_hot_dice(logits: torch.Tensor) -> torch.Tensor:
        valid = (target != 255)[:, None]
        probs = logits.softmax(dim=1) * valid
        one_hot = F.one_hot(torch.where(target == 255, 0, target), 8).permute(0, 3, 1, 2) * valid
        inter = (probs * one_hot).sum(dim=(0, 2, 3))
        dice = (2 * inter + 1) / (probs.sum(dim=(0, 2, 3)) + one_hot.sum(dim=(0, 2, 3)) + 1)
        return (1 - dice[1:]).mean()

    loss = softmax_dice_loss(logits, target, 255)
    expected = one_hot_dice(logits)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    assert grad[0, :, :2].abs().max() == 0  # ignored pixels get no gradient


def test_loss_is_weighted_cross_entropy_plus_dice():
    task = get_task("seg")
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, 29, (2, 8, 6), generator=g)
    target[0, 0, 0] = 255
    logits = torch.randn(2, 29, 8, 6, generator=g)
    loss, log = task.loss(logits, seg_batch(target))
    ce = F.cross_entropy(logits, target, ignore_index=255)
    assert log["cross_entropy"] == pytest.approx(ce.item(), rel=1e-6)
    assert loss.item() == pytest.approx(log["cross_entropy"] + log["dice"], rel=1e-6)
    weights = tuple(float(i % 3 + 1) for i in range(29))
    weighted = get_task("seg", class_weights=weights)
    _, log_w = weighted.loss(logits, seg_batch(target))
    ce_w = F.cross_entropy(logits, target, weight=torch.tensor(weights), ignore_index=255)
    assert log_w["cross_entropy"] == pytest.approx(ce_w.item(), rel=1e-6)
    with pytest.raises(ValueError, match="class_weights"):
        get_task("seg", class_weights=(1.0, 2.0))
    perfect, _ = task.loss(one_hot_logits(target.clamp(max=28), 29) * 5, seg_batch(target))
    assert perfect.item() < 0.05


def test_flip_map_swaps_left_and_right_parts():
    flip = dict(enumerate(SEG_FLIP))
    idx = SEG_CLASSES.index
    assert flip[idx("Left_Hand")] == idx("Right_Hand") and flip[idx("Right_Upper_Leg")] == idx(
        "Left_Upper_Leg"
    )
    assert flip[idx("Torso")] == idx("Torso") and flip[0] == 0
    assert all(SEG_FLIP[SEG_FLIP[i]] == i for i in range(29))
    assert sum(SEG_FLIP[i] != i for i in range(29)) == 16  # 8 left/right pairs


def test_visualize_blends_parts_and_keeps_background():
    task = get_task("seg")
    image = np.full((4, 4, 3), 100, np.uint8)
    classes = np.zeros((4, 4), np.uint8)
    classes[1:3, 1:3] = 22
    picture = task.visualize(image, classes)
    assert (picture[0, 0] == 100).all() and not (picture[1, 1] == 100).all()


def test_inverse_sqrt_frequency_weights_follow_the_counts_and_the_cap():
    weights = inverse_sqrt_frequency(np.array([400, 100, 4, 0]), max_weight=5.0)
    np.testing.assert_allclose(weights, [1.0, 2.0, 5.0, 5.0])  # sqrt(400/4) = 10, capped
    with pytest.raises(ValueError, match="no labelled pixels"):
        inverse_sqrt_frequency(np.zeros(3), 10.0)


def test_class_weighting_is_fitted_to_the_training_labels_and_changes_the_loss():
    task = get_task("seg", class_weighting="inverse_sqrt_frequency", max_class_weight=10.0)
    labels = np.zeros((8, 6), np.uint8)
    labels[:2, :2] = 3  # 4 pixels of class 3 beside 44 of background; 255 is ignored
    labels[-1, -1] = 255
    fitted = task.with_label_statistics([{"seg": labels}, {"seg": labels}])
    weights = np.array(fitted.class_weights)
    assert fitted.class_weighting is None and weights.shape == (29,)
    assert weights[0] == 1.0 and weights[3] == pytest.approx(np.sqrt(43 / 4))
    assert np.all(np.delete(weights, [0, 3]) == 10.0)  # absent classes get the cap
    assert get_task("seg").with_label_statistics([{"seg": labels}]) == get_task("seg")
    torch.manual_seed(0)
    pred = torch.randn(1, 29, 8, 6)
    batch = {"seg": torch.from_numpy(labels.astype(np.int64))[None]}
    assert not torch.isclose(fitted.loss(pred, batch)[0], task.loss(pred, batch)[0])


def test_class_weighting_settings_are_checked():
    with pytest.raises(ValueError, match="not both"):
        get_task("seg", class_weighting="inverse_sqrt_frequency", class_weights=(1.0,) * 29)
    with pytest.raises(ValueError, match="class_weighting"):
        get_task("seg", class_weighting="median_frequency")
    with pytest.raises(ValueError, match="max_class_weight"):
        get_task("seg", max_class_weight=0.5)
