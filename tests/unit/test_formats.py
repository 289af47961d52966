"""Label formats: synthetic samples survive write -> read in every format, and every reader
rejects malformed labels with the file and field in the message."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import cv2
import numpy as np
import pandas as pd
import pytest

from pipelines.cli import main as cli
from sapiens2.data.dataset import CuratedDataset
from sapiens2.data.formats import (read_coco, read_dense, read_manifest, read_seglabels,
                                   read_shards, write_coco, write_dense, write_manifest,
                                   write_shards)
from sapiens2.data.formats.export import export_curated
from sapiens2.data.synth import render_person

H, W = 64, 48


@pytest.fixture(scope="module")
def people() -> list[dict]:
    out = []
    for seed in range(4):
        sample = render_person(np.random.default_rng(seed), H, W)
        fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
        out.append({"id": f"p{seed}", **fields})
    return out


@pytest.fixture(scope="module")
def curated(people, tmp_path_factory):
    root = tmp_path_factory.mktemp("curated")
    splits = {p["id"]: ("val" if i == 3 else "train") for i, p in enumerate(people)}
    assert write_manifest(people, root, splits) == 4
    return root


def by_id(samples) -> dict[str, dict]:
    return {s["id"]: s for s in samples}


def test_manifest_round_trip_feeds_the_dataset(people, curated):
    read = by_id(read_manifest(curated))
    assert sorted(read) == [p["id"] for p in people]
    for person in people:
        got = read[person["id"]]
        for field in ("image", "keypoints", "seg", "mask", "pointmap", "albedo", "K", "bbox"):
            assert np.array_equal(got[field], person[field]), field
        assert np.allclose(got["normal"], person["normal"], atol=1e-3)  # stored as float16
    dataset = CuratedDataset(curated, "train", H, W, hflip_prob=0.0)
    assert dataset.ids == ["p0", "p1", "p2"]
    assert np.array_equal(dataset[1]["seg"], people[1]["seg"])
    assert [s["id"] for s in read_manifest(curated, "val")] == ["p3"]


def test_coco_round_trip(people, curated, tmp_path):
    assert export_curated(curated, "coco", tmp_path) == 4
    read = by_id(read_coco(tmp_path / "annotations.json"))
    for person in people:
        got = read[person["id"]]
        for field in ("image", "keypoints", "bbox", "mask"):
            assert np.array_equal(got[field], person[field]), field
        assert "seg" not in got and "K" not in got


def test_seglabels_round_trip(people, curated, tmp_path):
    assert export_curated(curated, "seglabels", tmp_path) == 4
    read = by_id(read_seglabels(tmp_path))
    for person in people:
        got = read[person["id"]]
        for field in ("image", "seg", "mask", "bbox"):
            assert np.array_equal(got[field], person[field]), field


@pytest.mark.parametrize("normal_suffix", [".npy", ".npz"])
def test_dense_round_trip(people, tmp_path, normal_suffix):
    assert write_dense(people, tmp_path, normal_suffix) == 4
    assert np.array_equal(np.loadtxt(tmp_path / "camera_extrinsics" / "p0.txt"), np.eye(4))
    read = by_id(read_dense(tmp_path))
    for person in people:
        got = read[person["id"]]
        for field in ("image", "mask", "albedo", "bbox"):
            assert np.array_equal(got[field], person[field]), field
        assert np.allclose(got["normal"], person["normal"], atol=1e-6)
        # depth -> pointmap by back-projection through the written intrinsics
        assert np.allclose(got["pointmap"], person["pointmap"], atol=1e-5)
        assert np.allclose(got["K"], person["K"], rtol=1e-6)
    # the reference convention puts pixel centres at integers: cx is 0.5 less on disk
    on_disk = np.loadtxt(tmp_path / "camera_intrinsics" / "p0.txt")
    assert on_disk[0, 2] == pytest.approx(people[0]["K"][0, 2] - 0.5)


def test_shards_round_trip(curated, tmp_path):
    rows = pd.read_parquet(curated / "manifest.parquet")
    splits = dict(zip(rows["id"], rows["split"], strict=True))
    assert write_shards(read_manifest(curated), tmp_path, splits, shard_size=2) == 4
    index = json.loads((tmp_path / "shards.json").read_text())
    assert [s["file"] for s in index["shards"]] == [
        "shards/train-00000.parquet", "shards/train-00001.parquet", "shards/val-00000.parquet"]
    assert [s["rows"] for s in index["shards"]] == [2, 1, 1]
    assert index["counts"] == {"train": 3, "val": 1}
    expected = by_id(read_manifest(curated))
    read = by_id(read_shards(tmp_path))
    assert sorted(read) == sorted(expected)
    for sample_id, sample in expected.items():
        got = read[sample_id]
        assert sorted(got) == sorted(sample)
        for field in set(sample) - {"id"}:
            assert got[field].dtype == sample[field].dtype, field
            assert np.array_equal(got[field], sample[field]), field
        assert got["normal"].dtype == np.float16
    assert [s["id"] for s in read_shards(tmp_path, "train")] == ["p0", "p1", "p2"]
    assert [s["id"] for s in read_shards(tmp_path, "val")] == ["p3"]
    assert sorted(next(read_shards(tmp_path, fields=("seg",)))) == ["id", "image", "seg"]
    assert export_curated(curated, "shards", tmp_path / "export") == 4  # keeps the manifest's splits
    assert json.loads((tmp_path / "export" / "shards.json").read_text())["counts"] == {"train": 3, "val": 1}
    assert [s["id"] for s in read_shards(tmp_path / "export", "val")] == ["p3"]
    assert cli(["export", "--curated", str(curated), "--format", "shards", "--split", "val",
                "--output", str(tmp_path / "cli")]) == 0
    assert [s["id"] for s in read_shards(tmp_path / "cli", "val")] == ["p3"]


def test_export_verb(curated, tmp_path):
    assert cli(["export", "--curated", str(curated), "--format", "dense", "--split", "val",
                "--output", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "rgb").iterdir()) == ["p3.png"]


def test_wholebody_parts_concatenate_in_order(people, tmp_path):
    kpts = np.concatenate([np.full((n, 3), i, np.float32) for i, n in
                           enumerate((17, 6, 68, 21, 21))])
    kpts[:, 2] = 2
    sample = {**{k: people[0][k] for k in ("id", "image", "bbox")}, "keypoints": kpts}
    write_coco([sample], tmp_path)
    ann = json.loads((tmp_path / "annotations.json").read_text())["annotations"][0]
    assert len(ann["keypoints"]) == 51 and len(ann["face_kpts"]) == 204
    whole = next(read_coco(tmp_path / "annotations.json", num_keypoints=133))
    assert np.array_equal(whole["keypoints"], kpts)
    body = next(read_coco(tmp_path / "annotations.json", parts=("keypoints",)))
    assert np.array_equal(body["keypoints"], kpts[:17])
    with pytest.raises(ValueError, match=r"annotations\.json.*'keypoints' holds 133 keypoints"):
        next(read_coco(tmp_path / "annotations.json"))


def test_coco_several_people_and_polygons(people, tmp_path):
    write_png = cv2.imwrite
    (tmp_path / "images").mkdir()
    write_png(str(tmp_path / "images" / "crowd.png"), people[0]["image"][..., ::-1])
    flat = people[0]["keypoints"].ravel().tolist()
    anns = [{"id": i, "image_id": 7, "category_id": 1, "iscrowd": 0, "keypoints": flat,
             "bbox": [2, 3, 10, 20], "segmentation": [[2, 3, 12, 3, 12, 23, 2, 23]]}
            for i in (11, 12)]
    (tmp_path / "a.json").write_text(json.dumps({
        "images": [{"id": 7, "file_name": "crowd.png", "height": H, "width": W}],
        "annotations": anns}))
    samples = list(read_coco(tmp_path / "a.json"))
    assert [s["id"] for s in samples] == ["crowd_11", "crowd_12"]
    assert samples[0]["mask"][10, 5] and not samples[0]["mask"][30, 30]
    assert np.array_equal(samples[0]["bbox"], [2, 3, 12, 23])


# --- malformed labels ---------------------------------------------------------------------


def test_coco_rejects_wrong_keypoint_count_and_missing_image(curated, tmp_path):
    export_curated(curated, "coco", tmp_path)
    path = tmp_path / "annotations.json"
    doc = json.loads(path.read_text())
    doc["annotations"][1]["keypoints"] = doc["annotations"][1]["keypoints"][:-3]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"annotations\.json: annotation 2 \(p1\.png\): "
                                         r"field 'keypoints' holds 16 keypoints.*expected 17"):
        list(read_coco(path))
    (tmp_path / "images" / "p0.png").unlink()
    with pytest.raises(ValueError, match=r"images/p0\.png: missing image file"):
        list(read_coco(path))


def test_coco_rejects_image_size_mismatch(curated, tmp_path):
    export_curated(curated, "coco", tmp_path)
    path = tmp_path / "annotations.json"
    doc = json.loads(path.read_text())
    doc["images"][0]["height"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"p0\.png field 'height' says 99, the file has 64"):
        list(read_coco(path))


def test_seglabels_rejects_bad_class_shape_mode_and_missing_file(curated, tmp_path):
    export_curated(curated, "seglabels", tmp_path)
    label = tmp_path / "labels" / "p1.png"
    seg = cv2.imread(str(label), cv2.IMREAD_UNCHANGED)
    seg[0, 0] = 40
    cv2.imwrite(str(label), seg)
    with pytest.raises(ValueError, match=r"labels/p1\.png: field 'seg' has class ids \[40\]"):
        list(read_seglabels(tmp_path))
    cv2.imwrite(str(label), seg[:-2])
    with pytest.raises(ValueError, match=r"labels/p1\.png: field 'seg' has shape \(62, 48\)"):
        list(read_seglabels(tmp_path))
    cv2.imwrite(str(label), np.zeros((H, W, 3), np.uint8))
    with pytest.raises(ValueError, match=r"labels/p1\.png: field 'seg' is a RGB image"):
        list(read_seglabels(tmp_path))
    label.unlink()
    with pytest.raises(ValueError, match=r"labels/p1\.png: missing label file"):
        list(read_seglabels(tmp_path))


def test_seglabels_class_map_renames_and_ignores(curated, tmp_path):
    export_curated(curated, "seglabels", tmp_path)
    sample = next(read_seglabels(tmp_path, class_map={0: 0, 22: 1}))
    assert set(np.unique(sample["seg"]).tolist()) <= {0, 1, 255}
    assert np.array_equal(sample["mask"], sample["seg"] == 1)


@pytest.mark.parametrize("damage,message", [
    (lambda d: np.save(d / "normal" / "p2.npy", np.zeros((H, W - 1, 3), np.float32)),
     r"normal/p2\.npy: field 'normal' has shape \(64, 47, 3\)"),
    (lambda d: np.save(d / "depth" / "p2.npy", np.zeros((H + 1, W), np.float32)),
     r"depth/p2\.npy: field 'depth' has shape \(65, 48\)"),
    (lambda d: np.savetxt(d / "camera_intrinsics" / "p2.txt", np.eye(3)[:2]),
     r"camera_intrinsics/p2\.txt: field 'K' has shape \(2, 3\)"),
    (lambda d: (d / "camera_extrinsics" / "p2.txt").unlink(),
     r"camera_extrinsics/p2\.txt: missing extrinsics file"),
    (lambda d: (d / "mask" / "p2.png").unlink(), r"mask/p2\.png: missing mask file"),
    (lambda d: cv2.imwrite(str(d / "albedo" / "p2.png"), np.zeros((H, 3, 3), np.uint8)),
     r"albedo/p2\.png: field 'albedo' has shape \(64, 3, 3\)"),
])
def test_dense_rejects_malformed_files(people, tmp_path, damage, message):
    write_dense(people, tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError, match=message):
        list(read_dense(tmp_path))


def test_manifest_rejects_wrong_keypoint_count(people, tmp_path):
    bad = dict(people[0], keypoints=people[0]["keypoints"][:15])
    write_manifest([bad], tmp_path)
    with pytest.raises(ValueError, match=r"labels/p0\.npz: field 'keypoints' has shape \(15, 3\)"):
        list(read_manifest(tmp_path))


@pytest.mark.parametrize("damage,message", [
    (lambda p: dict(p, keypoints=p["keypoints"][:15]),
     r"shards/train-00000\.parquet: row p1: field 'keypoints' has shape \(15, 3\)"),
    (lambda p: dict(p, seg=np.full_like(p["seg"], 40)),
     r"shards/train-00000\.parquet: row p1: field 'seg' has class ids \[40\]"),
    (lambda p: dict(p, seg=p["seg"][:-2]),
     r"shards/train-00000\.parquet: row p1: field 'seg' has shape \(62, 48\)"),
    (lambda p: dict(p, mask=p["mask"][:, :-1]),
     r"shards/train-00000\.parquet: row p1: field 'mask' has shape \(64, 47\)"),
])
def test_shards_reject_malformed_labels(people, tmp_path, damage, message):
    write_shards([damage(p) if p["id"] == "p1" else p for p in people], tmp_path, shard_size=2)
    with pytest.raises(ValueError, match=message):
        list(read_shards(tmp_path))


def test_shards_reject_damaged_files_and_missing_index(people, tmp_path):
    write_shards(people, tmp_path, shard_size=2)
    shard = tmp_path / "shards" / "train-00001.parquet"
    data = shard.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"shards/train-00001\.parquet: field 'sha256' in "
                                         r"shards\.json says [0-9a-f]{64}, the file has"):
        list(read_shards(tmp_path))
    shard.write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"shards/train-00001\.parquet: field 'bytes' in "
                                         rf"shards\.json says {len(data)}, the file has"):
        list(read_shards(tmp_path))

    shard.write_bytes(data)
    rows = pd.read_parquet(shard)
    rows.loc[1, "labels"] = rows.loc[0, "labels"]
    rows.to_parquet(shard, index=False)
    index = json.loads((tmp_path / "shards.json").read_text())
    index["shards"][1].update(bytes=shard.stat().st_size,
                              sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    (tmp_path / "shards.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shards/train-00001\.parquet: row p3: field 'sha256'"):
        list(read_shards(tmp_path))

    (tmp_path / "shards.json").unlink()
    with pytest.raises(ValueError, match=r"shards\.json: missing index"):
        list(read_shards(tmp_path))


def test_a_label_archive_that_expands_past_the_limit_is_refused_before_inflating(tmp_path) -> None:
    import zipfile

    from sapiens2.data.npz import open_npz

    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("seg.npy", b"\0" * (8 << 20))  # 8 MiB of zeros: a few KiB on disk
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(ValueError, match=r"bomb\.npz: label arrays expand to 8,388,608 bytes"):
        open_npz(bomb, max_bytes=1 << 20)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"junk\.npz: not an \.npz archive"):
        open_npz(tmp_path / "junk.npz")
    np.savez(tmp_path / "ok.npz", seg=np.arange(6).reshape(2, 3))
    with open_npz((tmp_path / "ok.npz").read_bytes()) as labels:
        assert labels["seg"].shape == (2, 3)
