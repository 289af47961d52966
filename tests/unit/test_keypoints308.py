"""The 308-keypoint layout (names, sigmas, flips, skeleton) and pose-task support for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sapiens2.labels.face238 import FACE_NAMES, FACE_XY
from sapiens2.labels.keypoint_sets import get_keypoint_set
from sapiens2.labels.keypoints308 import (KEYPOINT308_FLIP_PAIRS, KEYPOINT308_GROUPS, KEYPOINT308_ID,
                                   KEYPOINT308_NAMES, KEYPOINT308_OKS_SIGMAS, KEYPOINT308_SKELETON,
                                   mirror_name)
from sapiens2.labels import COCO_FLIP_PAIRS, COCO_KEYPOINT_NAMES, COCO_OKS_SIGMAS, COCO_SKELETON
from sapiens2.tasks import get_task
from sapiens2.tasks.keypoint_codec import flip_index


def test_layout_has_the_reference_group_sizes_in_order():
    assert len(KEYPOINT308_NAMES) == 308 == len(set(KEYPOINT308_NAMES))
    sizes = {g: len(ix) for g, ix in KEYPOINT308_GROUPS.items()}
    assert sizes == {"body": 17, "foot": 6, "hands": 40, "extra": 7, "face": 238}
    order = [i for g in ("body", "foot", "hands", "extra", "face") for i in KEYPOINT308_GROUPS[g]]
    assert order == list(range(308))
    assert KEYPOINT308_NAMES[:17] == COCO_KEYPOINT_NAMES
    assert KEYPOINT308_NAMES[70:] == FACE_NAMES
    assert all(n.startswith("right_") for n in KEYPOINT308_NAMES[23:43])
    assert all(n.startswith("left_") for n in KEYPOINT308_NAMES[43:63])


def test_sigmas_are_coco_wholebody_where_names_match_else_default():
    sig = dict(zip(KEYPOINT308_NAMES, KEYPOINT308_OKS_SIGMAS, strict=True))
    assert len(KEYPOINT308_OKS_SIGMAS) == 308
    assert KEYPOINT308_OKS_SIGMAS[:17] == COCO_OKS_SIGMAS
    assert (sig["left_big_toe"], sig["left_heel"], sig["right_small_toe"]) == (0.068, 0.066, 0.094)
    # COCO-WholeBody hand points 1-4 are the thumb, 5-8 the forefinger (base to tip).
    assert (sig["left_thumb_cmc"], sig["right_thumb_tip"], sig["left_forefinger_tip"]) == (
        0.022, 0.047, 0.035)
    assert sig["right_pinky_finger_tip"] == sig["left_pinky_finger_tip"] == 0.031
    assert sig["face_right_jaw_8"] == 0.042 and sig["face_chin"] == 0.020  # iBUG 0 and 8
    assert sig["face_left_eye_outer_corner"] == 0.012  # iBUG 45
    for name in ("neck", "left_olecranon", "face_left_pupil", "face_forehead_2", "face_glabella"):
        assert sig[name] == 0.010, name


def test_flip_pairs_are_an_involution_that_mirrors_names():
    index = flip_index(308, KEYPOINT308_FLIP_PAIRS)
    assert index != list(range(308))
    assert [index[i] for i in index] == list(range(308))
    used = [i for pair in KEYPOINT308_FLIP_PAIRS for i in pair]
    assert len(used) == len(set(used))
    for i, name in enumerate(KEYPOINT308_NAMES):
        assert KEYPOINT308_NAMES[index[i]] == mirror_name(name)
        sided = {"left", "right"} & set(name.split("_"))
        assert (index[i] != i) == bool(sided), name
        if i in KEYPOINT308_GROUPS["hands"]:  # COCO-WholeBody's hands share their sigmas
            assert KEYPOINT308_OKS_SIGMAS[index[i]] == KEYPOINT308_OKS_SIGMAS[i]


def test_face_template_is_mirror_symmetric_and_on_the_front_of_the_head():
    ids = {n: i for i, n in enumerate(FACE_NAMES)}
    for i, name in enumerate(FACE_NAMES):
        j = ids[mirror_name(name)]
        np.testing.assert_allclose(FACE_XY[j], FACE_XY[i] * [-1, 1], atol=1e-12, err_msg=name)
    assert np.hypot(*FACE_XY.T).max() < 0.9  # z = sqrt(1 - r^2) > 0.4: facing forward
    left = [ids[n] for n in FACE_NAMES if "_left_" in n]
    assert (FACE_XY[left, 0] > 0).all()  # x points to the person's own left
    assert len({tuple(p) for p in FACE_XY.round(6)}) == 238  # no two landmarks coincide


def test_skeleton_is_in_range_and_maps_onto_itself_under_a_flip():
    index = flip_index(308, KEYPOINT308_FLIP_PAIRS)
    edges = {frozenset(e) for e in KEYPOINT308_SKELETON}
    assert all(0 <= i < 308 for e in KEYPOINT308_SKELETON for i in e)
    assert all(len(e) == 2 for e in edges)
    assert {frozenset(index[i] for i in e) for e in edges} == edges
    ends = {i for e in KEYPOINT308_SKELETON for i in e}
    assert {KEYPOINT308_ID["left_pinky_finger_tip"], KEYPOINT308_ID["face_chin"]} <= ends


def test_pose_task_defaults_stay_coco17_and_308_is_opt_in():
    coco = get_task("pose")
    assert (coco.keypoint_set, coco.num_keypoints) == ("coco17", 17)
    assert coco.flip_pairs == COCO_FLIP_PAIRS and coco.oks_sigmas == COCO_OKS_SIGMAS
    assert coco.skeleton == COCO_SKELETON and coco.eval_groups == ()
    task = get_task("pose", keypoint_set="sapiens308")
    kset = get_keypoint_set("sapiens308")
    assert task.num_keypoints == 308 and task.flip_pairs == KEYPOINT308_FLIP_PAIRS
    assert task.oks_sigmas == kset.oks_sigmas and task.skeleton == KEYPOINT308_SKELETON
    assert [g for g, _ in task.eval_groups] == ["body", "foot", "face", "hands"]
    head = task.build_head(64, "tiny")
    # tiny heads refine with the image at 16x the token grid (detail pyramid)
    heatmaps = head(torch.zeros(1, 64, 4, 3), torch.zeros(1, 3, 64, 48))
    assert heatmaps.shape[1] == 308
    with pytest.raises(ValueError, match="keypoint set"):
        get_task("pose", keypoint_set="coco133")
    with pytest.raises(ValueError, match="oks_sigmas"):
        get_task("pose", keypoint_set="sapiens308", oks_sigmas=COCO_OKS_SIGMAS)


def coco_ap(oks_by_rank: list[float], threshold: float) -> float:
    """COCO AP for one person per image, detections listed by descending score: 101-point
    interpolated precision over recall, a detection matching iff its OKS >= threshold."""
    tp = np.cumsum(np.asarray(oks_by_rank) >= threshold)
    recall = tp / len(oks_by_rank)
    precision = tp / np.arange(1, len(oks_by_rank) + 1)
    return float(np.mean([precision[recall >= r].max() if (recall >= r).any() else 0.0
                          for r in np.linspace(0, 1, 101)]))


def oks(gt: np.ndarray, dt: np.ndarray, sigmas: np.ndarray, area: float) -> float:
    d2 = ((gt[:, :2] - dt[:, :2]) ** 2).sum(-1)
    return float(np.exp(-d2 / (2 * sigmas) ** 2 / area / 2).mean())


def test_oks_ap_per_subset_matches_hand_computation():
    """Image a: perfect but for a small face shift; image b (lower score): same face shift and
    hands 40 px off. Body and foot AP 1, face AP = thresholds its OKS passes, hands AP
    51/101 (recall 0.5 at precision 1, never more), whole body from the 308-point OKS."""
    task = get_task("pose", keypoint_set="sapiens308")
    rng = np.random.default_rng(0)
    bbox = np.array([40.0, 30.0, 150.0, 230.0], np.float32)
    area = 110.0 * 200.0
    face, hands = list(KEYPOINT308_GROUPS["face"]), list(KEYPOINT308_GROUPS["hands"])
    records, gts, dts = [], [], []
    for image_id, score in (("a", 0.9), ("b", 0.5)):
        gt = np.concatenate([rng.uniform([60, 60], [130, 200], (308, 2)), np.full((308, 1), 2.0)], 1)
        dt = gt.copy()
        dt[:, 2] = score
        dt[face, :2] += [2.0, 1.0]
        if image_id == "b":
            dt[hands, :2] += [40.0, 0.0]
        gts.append(gt)
        dts.append(dt)
        records.append({"id": image_id, "gt": gt.astype(np.float32), "bbox": bbox,
                        "dt": dt.astype(np.float32)})
    metric = task.metric()
    metric.load_state_dict({"records": records})
    result = metric.compute()
    sigmas = np.asarray(task.oks_sigmas)
    face_oks = oks(gts[0][face], dts[0][face], sigmas[face], area)
    thresholds = np.linspace(0.5, 0.95, 10)
    assert min(abs(face_oks - thresholds)) > 0.005
    assert result["body_AP"] == pytest.approx(1.0) and result["foot_AP"] == pytest.approx(1.0)
    assert result["face_AP"] == pytest.approx(float(np.mean(face_oks >= thresholds)))
    assert 0.0 < result["face_AP"] < 1.0 and result["face_AP50"] == pytest.approx(1.0)
    assert result["hands_AP"] == pytest.approx(51 / 101)
    whole = [oks(g, d, sigmas, area) for g, d in zip(gts, dts)]
    expected = np.mean([coco_ap(whole, t) for t in thresholds])
    assert result["AP"] == pytest.approx(expected, abs=1e-9)
    assert result["AP"] not in (result["face_AP"], result["hands_AP"])
    assert not any(k.startswith("extra_") for k in result)
