"""The model stages whose weights ship inside pip packages: safety (NudeNet), text_ocr (PP-OCRv4
detection) and head_pose (BlazeFace + face mesh + PnP), on packaged photographs.

Measured (this code, one thread): nsfw_score astronaut 0.018, coffee 0.296 (BUTTOCKS_EXPOSED on
the crema), rocket 0.001, grace_hopper 0.004. ocr_text_area astronaut and coffee 0.000, rocket
0.011, grace_hopper 0.031 (a row of flag stars); captioned coffee 0.368 and astronaut 0.295; one
4x title line on coffee 0.251, where the classical text_score is 0.000 (glyphs above its 12 %
height cap). Head pose (yaw, pitch, roll): astronaut (-4.0, 35.5, 2.3), grace_hopper (-0.7,
15.6, -3.8); mirrored |yaw + yaw'| 1.3 and 1.6; +-20 degree rotations shift roll by 19.0-21.2.
On the synthetic pool (seed 0, 600 images): text_ocr and text_overlay both 1.00/1.00, but
text_ocr separates wider (overlays >= 0.256 vs others 0.000; text_score 0.118 vs 0.034); the
safety stage rejects 2/420 synthetic people at 0.5 (scores 0.54, 0.63); no synthetic person
(~10 px faces) has a face BlazeFace finds.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
from matplotlib import cbook
from PIL import Image
from skimage import data as skimage_data

from sapiens2.curation import REASONS, CurationConfig, FilterChain
from sapiens2.curation.config import HeadPoseConfig, OcrConfig, SafetyConfig
from sapiens2.curation.head_pose import FACE_3D, camera_matrix, head_angles
from sapiens2.curation.ocr import _horizontal_line
from sapiens2.curation.stages import STAGES, build_stages
from sapiens2.data.synth import distractors
from sapiens2.data.synth.person import render_person

PEOPLE, OBJECTS = ("astronaut", "hopper"), ("coffee", "rocket")


def _load(name: str) -> np.ndarray:
    if name == "hopper":
        return np.asarray(Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB"))
    return getattr(skimage_data, name)()[..., :3]


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    """Real photographs shipped inside scikit-image and matplotlib (no download)."""
    return {name: _load(name) for name in (*PEOPLE, *OBJECTS)}


def _captioned(image: np.ndarray, lines: int = 4, scale: float = 2.0) -> np.ndarray:
    """``image`` with ``lines`` lines of large white caption text spread down the frame."""
    out = image.copy()
    for k in range(lines):
        y = int((k + 1) * out.shape[0] / (lines + 0.5))
        cv2.putText(out, "SALE 50% OFF" if k % 2 == 0 else "shop.com", (15, y), cv2.FONT_HERSHEY_SIMPLEX, scale,
                    (255, 255, 255), max(2, int(2.5 * scale)), cv2.LINE_AA)
    return out


def _stage(name: str, **update):
    config = CurationConfig(stages=("size", "phash", name)).model_copy(update=update)
    return build_stages(config)[-1]


def _scores(stage, images: list[np.ndarray]) -> list[dict]:
    columns = stage.score(images)
    return [{col: values[i] for col, values in columns.items()} for i in range(len(images))]


@pytest.fixture(scope="module")
def safety():
    return _stage("safety")


@pytest.fixture(scope="module")
def text_ocr():
    return _stage("text_ocr")


@pytest.fixture(scope="module")
def head_pose():
    return _stage("head_pose")


def test_model_stages_are_registered_with_manifest_reasons():
    for name, reason in (("safety", "unsafe"), ("text_ocr", "text_overlay"), ("head_pose", "head_pose")):
        assert STAGES[name].reason == reason and reason in REASONS
    assert not {"safety", "text_ocr", "head_pose"} & set(CurationConfig().stages)  # opt-in only


def test_model_stage_configs_reject_bad_values_naming_the_field(tmp_path):
    path = tmp_path / "curation.yaml"
    path.write_text("safety:\n  unsafe_classes: [NAKED]\n")
    with pytest.raises(ValueError, match=r"curation.yaml.*safety\.unsafe_classes"):
        CurationConfig.from_yaml(path)
    with pytest.raises(ValueError, match="multiple of 32"):
        OcrConfig(long_side=100)
    with pytest.raises(ValueError, match="max_abs_yaw"):
        HeadPoseConfig(max_abs_yaw=-5)


# ---- safety ---------------------------------------------------------------------------------


def test_safety_keeps_the_packaged_photos_deterministically(safety, photos):
    images = list(photos.values())
    rows = _scores(safety, images)
    limit = SafetyConfig().max_nsfw_score
    assert all(0.0 <= row["nsfw_score"] < limit for row in rows), rows
    assert all(safety.judge(row) is None for row in rows)
    assert set(safety.nsfw_class(images)) <= set(SafetyConfig().unsafe_classes)
    again = _scores(safety, images)
    single = [_scores(safety, [image])[0] for image in images]
    assert [r["nsfw_score"] for r in again] == [r["nsfw_score"] for r in rows]
    assert np.allclose([r["nsfw_score"] for r in single], [r["nsfw_score"] for r in rows], atol=1e-5)


def test_safety_rejects_above_a_lowered_threshold(photos):
    row = _scores(_stage("safety"), [photos["coffee"]])[0]
    assert row["nsfw_score"] > 0.1  # the crema reads as skin to NudeNet: a measurable, safe score
    strict = _stage("safety", safety=SafetyConfig(max_nsfw_score=row["nsfw_score"] - 0.05))
    assert f"unsafe-class score {row['nsfw_score']:.3f}" in strict.judge(row)
    assert strict.judge(_scores(strict, [photos["rocket"]])[0]) is None


# ---- text_ocr -------------------------------------------------------------------------------


def test_text_ocr_rejects_captions_and_keeps_clean_photos(text_ocr, photos):
    limit = OcrConfig().max_text_area
    clean = _scores(text_ocr, list(photos.values()))
    assert all(row["ocr_text_area"] < limit for row in clean), clean
    assert all(text_ocr.judge(row) is None for row in clean)
    captioned = _scores(text_ocr, [_captioned(photos["coffee"]), _captioned(photos["astronaut"])])
    for row in captioned:
        assert row["ocr_text_area"] > 2 * limit and row["ocr_boxes"] >= 3
        assert "OCR text boxes cover" in text_ocr.judge(row)


def test_text_ocr_finds_a_large_title(text_ocr, photos):
    """One line of 4x Hershey text: glyphs above the classical stage's 12 %-of-height cap."""
    titled = _captioned(photos["coffee"], lines=1, scale=4.0)
    row = _scores(text_ocr, [titled])[0]
    classical = _scores(_stage("text_overlay"), [titled])[0]
    print(f"title: ocr_text_area {row['ocr_text_area']:.3f}, classical text_score {classical['text_score']:.3f}")
    assert text_ocr.judge(row) is not None


def test_only_horizontal_elongated_boxes_count_as_text():
    def box(w, h, angle):
        return cv2.boxPoints(((50.0, 50.0), (w, h), angle))

    assert _horizontal_line(box(60, 10, 0), 1.5) and _horizontal_line(box(10, 60, 90), 1.5)
    assert _horizontal_line(box(60, 10, 30), 1.5)
    assert not _horizontal_line(box(10, 60, 0), 1.5)  # an upright figure
    assert not _horizontal_line(box(60, 10, 60), 1.5)  # steeper than 45 degrees
    assert not _horizontal_line(box(20, 16, 0), 1.5)  # a blob


def test_text_ocr_separates_synthetic_people_from_their_captioned_copies(text_ocr):
    """Upscaled 128x96 renders: an upright person must not read as one tall text line."""
    people = [render_person(np.random.default_rng([7, i, 0]), 128, 96).image for i in range(12)]
    captioned = [distractors.text_overlay(np.random.default_rng([7, i, 2]), p) for i, p in enumerate(people)]
    kept = [text_ocr.judge(row) is None for row in _scores(text_ocr, people)]
    caught = [text_ocr.judge(row) is not None for row in _scores(text_ocr, captioned)]
    assert sum(kept) == len(people) and sum(caught) == len(captioned), (kept, caught)


# ---- head_pose ------------------------------------------------------------------------------


def _rotate(image: np.ndarray, degrees: float) -> np.ndarray:
    """Turn ``image`` counter-clockwise (as displayed) by ``degrees`` about its centre."""
    height, width = image.shape[:2]
    matrix = cv2.getRotationMatrix2D((width / 2, height / 2), degrees, 1.0)
    return cv2.warpAffine(image, matrix, (width, height), borderMode=cv2.BORDER_REFLECT)


def _rotation(yaw: float, pitch: float, roll: float) -> np.ndarray:
    y, p, r = (math.radians(a) for a in (yaw, pitch, roll))
    rx = np.array([[1, 0, 0], [0, math.cos(p), -math.sin(p)], [0, math.sin(p), math.cos(p)]])
    ry = np.array([[math.cos(y), 0, math.sin(y)], [0, 1, 0], [-math.sin(y), 0, math.cos(y)]])
    rz = np.array([[math.cos(r), -math.sin(r), 0], [math.sin(r), math.cos(r), 0], [0, 0, 1]])
    return rz @ ry @ rx


@pytest.mark.parametrize("angles", [(20, 0, 0), (0, 20, 0), (0, 0, 20), (-35, 10, -15)])
def test_pnp_recovers_a_projected_template_in_the_documented_axes(angles):
    model = np.array(list(FACE_3D.values()))
    rvec = cv2.Rodrigues(_rotation(*angles))[0]
    points = cv2.projectPoints(model, rvec, np.array([0.0, 0.0, 2500.0]), camera_matrix(480, 640), None)[0][:, 0]
    assert np.allclose(head_angles(points, 480, 640), angles, atol=0.1)
    nose, eyes, mouth = points[0], points[2:4], points[4:6]
    yaw, pitch, roll = angles
    if sum(a != 0 for a in angles) > 1:
        return  # directions are checked one axis at a time
    if yaw:  # positive yaw: the nose points to the image's left
        assert np.sign(eyes[:, 0].mean() - nose[0]) == np.sign(yaw)
    if pitch:  # positive pitch: the nose drops toward the mouth
        assert nose[1] > (eyes[:, 1].mean() + mouth[:, 1].mean()) / 2 + 5
    if roll:  # positive roll: clockwise on screen, the image-right eye sits lower
        assert np.sign(eyes[1, 1] - eyes[0, 1]) == np.sign(roll)


def test_head_pose_finds_faces_only_on_people(head_pose, photos):
    rows = dict(zip(photos, _scores(head_pose, list(photos.values()))))
    assert {name: row["face_found"] for name, row in rows.items()} == {"astronaut": 1, "hopper": 1, "coffee": 0,
                                                                       "rocket": 0}
    for name in OBJECTS:
        assert all(math.isnan(rows[name][col]) for col in ("head_yaw", "head_pitch", "head_roll"))
    for name in PEOPLE:
        assert abs(rows[name]["head_yaw"]) < 25 and abs(rows[name]["head_roll"]) < 10, rows[name]


@pytest.mark.parametrize("name", PEOPLE)
def test_mirroring_negates_yaw_and_rotation_shifts_roll(head_pose, photos, name):
    image = photos[name]
    base, mirrored, left, right = _scores(head_pose, [image, image[:, ::-1].copy(), _rotate(image, 20),
                                                      _rotate(image, -20)])
    assert abs(mirrored["head_yaw"] + base["head_yaw"]) < 4, (base, mirrored)
    assert abs(mirrored["head_roll"] + base["head_roll"]) < 4, (base, mirrored)
    # Positive roll is clockwise on screen: a counter-clockwise turn of the image lowers it.
    assert abs(left["head_roll"] - base["head_roll"] + 20) < 6, (base, left)
    assert abs(right["head_roll"] - base["head_roll"] - 20) < 6, (base, right)
    assert abs(left["head_yaw"] - base["head_yaw"]) < 6 and abs(right["head_yaw"] - base["head_yaw"]) < 6


def test_head_pose_judges_yaw_only_when_a_limit_is_set(head_pose, photos):
    row = _scores(head_pose, [photos["astronaut"]])[0]
    none = _scores(head_pose, [photos["coffee"]])[0]
    assert head_pose.judge(row) is None  # score-only by default
    strict = _stage("head_pose", head_pose=HeadPoseConfig(max_abs_yaw=abs(row["head_yaw"]) / 2))
    assert "head yaw" in strict.judge(row)
    assert strict.judge(none) is None  # no face: nothing to judge


# ---- through the filter chain ---------------------------------------------------------------


@pytest.fixture(scope="module")
def files(photos, tmp_path_factory):
    """The photos as files: JPEGs (decoded in draft mode down to the stage's input side) and PNGs."""
    root = tmp_path_factory.mktemp("photos")
    images = photos | {"coffee_text": _captioned(photos["coffee"])}
    paths = {}
    for name, image in images.items():
        paths[name] = root / (f"{name}.png" if name == "rocket" else f"{name}.jpg")
        Image.fromarray(image).save(paths[name], quality=92)
    return paths


@pytest.mark.parametrize("stage, columns, rejected", [
    ("safety", ("nsfw_score",), {}),
    ("text_ocr", ("ocr_text_area", "ocr_boxes"), {"coffee_text": "text_overlay"}),
    ("head_pose", ("face_found", "head_yaw", "head_pitch", "head_roll"), {}),
])
def test_each_model_stage_runs_in_the_filter_chain(files, stage, columns, rejected):
    chain = FilterChain(CurationConfig(stages=("size", "phash", stage)))
    rows = dict(zip(files, chain.assess_batch(list(files.values()))))
    assert set(columns) <= set(chain.columns)
    assert all(row[col] is not None for row in rows.values() for col in columns)
    assert {name: row["reason"] for name, row in rows.items() if row["status"] != "kept"} == rejected
    if stage == "head_pose":
        assert {name: row["face_found"] for name, row in rows.items()} == {
            "astronaut": 1, "hopper": 1, "coffee": 0, "rocket": 0, "coffee_text": 0}
        assert abs(rows["hopper"]["head_yaw"]) < 25
