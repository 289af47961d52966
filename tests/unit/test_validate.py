"""Great-expectations gates on a small hand-built curated dataset: passes when consistent,
names the broken expectation when one label or manifest field is corrupted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipelines.common.dataset_stats import TASKS, build_counts, build_label_manifests, write_label_manifests
from pipelines.validate import SuiteResult, main, validate_curated

H, W = 32, 24


def _label(rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = np.zeros((H, W), bool)
    mask[4:28, 6:18] = True
    seg = np.where(mask, rng.integers(1, 29, size=(H, W)), 0).astype(np.uint8)
    normal = np.zeros((H, W, 3), np.float32)
    n = rng.normal(size=(int(mask.sum()), 3))
    normal[mask] = n / np.linalg.norm(n, axis=1, keepdims=True)
    K = np.array([[30.0, 0, W / 2], [0, 30.0, H / 2], [0, 0, 1]], np.float32)
    rows, cols = np.nonzero(mask)
    z = rng.uniform(2.0, 3.0, size=rows.size)
    pointmap = np.zeros((H, W, 3), np.float32)
    pointmap[rows, cols] = np.stack([(cols + 0.5 - K[0, 2]) * z / K[0, 0],
                                     (rows + 0.5 - K[1, 2]) * z / K[1, 1], z], axis=1)
    keypoints = np.column_stack([rng.uniform(6, 18, 17), rng.uniform(4, 28, 17),
                                 rng.choice([1.0, 2.0], 17)]).astype(np.float32)
    keypoints[0] = (-5.0, 40.0, 0.0)  # outside the image, correctly marked invisible
    albedo = np.where(mask[..., None], rng.integers(20, 230, (H, W, 3)), 0).astype(np.uint8)
    return dict(keypoints=keypoints, seg=seg, mask=mask, normal=normal.astype(np.float16),
                pointmap=pointmap, albedo=albedo, K=K, bbox=np.array([6, 4, 18, 28], np.float32))


def _write(root: Path, rows: list[dict], labels: dict[str, dict]) -> None:
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(exist_ok=True)
    for row in rows:
        if row["status"] == "kept":
            (root / "images" / f"{row['id']}.png").write_bytes(b"png")
    for image_id, arrays in labels.items():
        np.savez(root / "labels" / f"{image_id}.npz", **arrays)
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet", index=False)


def _row(i: int, status: str = "kept", reason: str | None = None, split: str | None = "train") -> dict:
    return dict(id=f"{i:05d}", path=f"images/{i:05d}.png", status=status, reason=reason,
                width=W, height=H, short_side=min(W, H), sharpness=120.0 + i, brightness=110.0,
                clipped_fraction=0.01, person_score=0.9, num_persons=1, text_score=0.02,
                phash=f"{i:016x}", dup_group=None, split=split)


@pytest.fixture()
def curated(tmp_path: Path) -> tuple[Path, list[dict], dict]:
    rng = np.random.default_rng(0)
    rows = [_row(i, split="val" if i % 3 == 0 else "train") for i in range(6)]
    rows += [_row(6, "rejected", "too_small", None), _row(7, "quarantined", "unreadable", None),
             {**_row(8, "rejected", "duplicate", None), "dup_group": "00001"}]
    labels = {r["id"]: _label(rng) for r in rows if r["status"] == "kept"}
    _write(tmp_path, rows, labels)
    return tmp_path, rows, labels


def _by_suite(results: list[SuiteResult]) -> dict[str, SuiteResult]:
    return {r.suite: r for r in results}


def _failed_columns(result: SuiteResult) -> set[str | None]:
    return {f.column for f in result.failed}


def test_label_manifests_have_one_row_per_kept_image(curated) -> None:
    root, _, labels = curated
    tables = build_label_manifests(root)
    assert not list((root / "labels").glob("*.parquet")), "building the tables writes nothing"
    written = write_label_manifests(root)
    assert set(tables) == set(TASKS)
    for task, table in tables.items():
        assert sorted(table["id"]) == sorted(labels)
        pd.testing.assert_frame_equal(pd.read_parquet(root / "labels" / f"{task}.parquet"), written[task])
    assert (tables["pose"]["num_keypoints"] == 17).all()
    assert (tables["pose"]["num_out_of_bounds"] == 0).all()
    assert tables["pointmap"]["median_reprojection_px"].max() < 1e-3
    assert tables["normal"]["max_norm_error"].max() < 1e-2
    assert tables["seg"]["class_max"].max() <= 28


def test_consistent_dataset_passes_every_suite(curated) -> None:
    root, rows, _ = curated
    results = _by_suite(validate_curated(root, input_count=len(rows)))
    assert set(results) == {"curated_manifest", "curated_counts", *(f"labels_{t}" for t in TASKS)}
    failures = {name: r.failed for name, r in results.items() if not r.success}
    assert failures == {}
    assert all(r.evaluated > 3 for r in results.values())


def test_manifest_faults_are_named(curated) -> None:
    root, rows, _ = curated
    rows[0]["split"] = "test"        # kept row outside {train, val}
    rows[6]["reason"] = None         # rejected without a reason
    rows[2]["id"] = rows[1]["id"]    # duplicate id
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet", index=False)
    result = _by_suite(validate_curated(root))["curated_manifest"]
    assert not result.success
    failed = {(f.expectation_type, f.column) for f in result.failed}
    assert ("expect_column_values_to_be_in_set", "split") in failed
    assert ("expect_column_values_to_not_be_null", "reason") in failed
    assert ("expect_column_values_to_be_unique", "id") in failed
    split_failure = next(f for f in result.failed if f.column == "split")
    assert split_failure.ids == [rows[0]["id"]] and "'test'" in split_failure.observed


def test_counts_catch_missing_files_and_wrong_input_count(curated) -> None:
    root, rows, labels = curated
    (root / "images" / f"{rows[0]['id']}.png").unlink()
    (root / "labels" / f"{rows[1]['id']}.npz").unlink()
    counts = build_counts(root, input_count=len(rows) + 1)
    assert counts.loc[0, "image_files"] == counts.loc[0, "label_files"] == len(labels) - 1
    results = _by_suite(validate_curated(root, input_count=len(rows) + 1))
    # A kept image without labels is allowed (it still serves pretraining); a missing image is not.
    assert _failed_columns(results["curated_counts"]) == {"kept_rows,image_files", "manifest_rows,input_count"}
    assert len(build_label_manifests(root)["pose"]) == len(labels) - 1


def _point_off_image(z: dict) -> None:
    z["keypoints"][1] = (500.0, 10.0, 2.0)


def _drop_keypoints(z: dict) -> None:
    z["keypoints"] = z["keypoints"][:15]


def _bad_class(z: dict) -> None:
    z["seg"][5, 8] = 29


def _normal_on_background(z: dict) -> None:
    z["normal"][0, 0] = 0.5


def _unnormalised_normals(z: dict) -> None:
    z["normal"] = z["normal"] * np.float16(2)


def _wrong_focal(z: dict) -> None:
    z["K"] = z["K"] * np.array([[1.2], [1.0], [1.0]], np.float32)


def _short_albedo(z: dict) -> None:
    z["albedo"] = z["albedo"][:-1]


def test_label_faults_fail_only_their_task_suite(curated) -> None:
    root, _, labels = curated
    faults = {"pose": [(_point_off_image, "num_out_of_bounds"), (_drop_keypoints, "num_keypoints")],
              "seg": [(_bad_class, "class_max")],
              "normal": [(_normal_on_background, "nonzero_outside_mask"),
                         (_unnormalised_normals, "max_norm_error")],
              "pointmap": [(_wrong_focal, "median_reprojection_px")],
              "albedo": [(_short_albedo, "shape_matches")]}
    ids = sorted(labels)
    corrupted = {i: {k: v.copy() for k, v in labels[i].items()} for i in ids}
    for task_faults in faults.values():
        for n, (corrupt, _) in enumerate(task_faults):
            corrupt(corrupted[ids[n + 1]])  # image 0 stays clean in every task
    for image_id, arrays in corrupted.items():
        np.savez(root / "labels" / f"{image_id}.npz", **arrays)
    results = _by_suite(validate_curated(root))
    for task, task_faults in faults.items():
        assert _failed_columns(results[f"labels_{task}"]) == {column for _, column in task_faults}, task
    assert results["curated_manifest"].success and results["curated_counts"].success


def test_cli_exit_status_lists_failures(curated, capsys) -> None:
    root, rows, _ = curated
    assert main(["--curated", str(root)]) == 0
    rows[3]["status"] = "maybe"
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet", index=False)
    assert main(["--curated", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAIL curated_manifest" in out and "status" in out
