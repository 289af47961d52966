"""`evaluate_task` on a tiny curated split with a debug-size model: trivial baselines fitted on
train and scored on val beside the model, the untrained head and a from-scratch model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from pipelines.common.config import load_config
from pipelines.common.eval_report import TaskEvaluation
from pipelines.evaluate import _scratch_dir, _tracked_metrics, batches, evaluate_task, score_predictions, split_id
from sapiens2.data.dataset import CuratedDataset
from sapiens2.model import build_backbone, save_checkpoint
from sapiens2.tasks import get_task
from sapiens2.tasks.baselines import fit_baselines
from tests.unit.test_dataset import make_labels
from tests.unit.test_predict import SIZE, make_model_dir


@pytest.fixture(scope="module")
def curated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four train and two val images (32x24 PNGs with labels; read back at 64x48)."""
    root = tmp_path_factory.mktemp("curated")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i, split in enumerate(["train"] * 4 + ["val"] * 2):
        image_id = f"{i:05d}"
        cv2.imwrite(str(root / "images" / f"{image_id}.png"), rng.integers(0, 256, (32, 24, 3), dtype=np.uint8))
        np.savez(root / "labels" / f"{image_id}.npz", **make_labels(rng))
        rows.append({"id": image_id, "path": f"images/{image_id}.png", "status": "kept", "split": split})
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet")
    return root


def model_dir(folder: Path, task: str) -> Path:
    """A debug model folder whose model.json names the backbone its untrained head starts from."""
    make_model_dir(folder, task)
    backbone = save_checkpoint(build_backbone("sapiens2_debug", img_size=SIZE), folder / "backbone.safetensors")
    spec = json.loads((folder / "model.json").read_text()) | {"backbone_init": str(backbone)}
    (folder / "model.json").write_text(json.dumps(spec))
    return folder


@pytest.mark.parametrize("task", ["seg", "pose"])
def test_evaluate_task_scores_model_beside_every_baseline(tmp_path: Path, curated: Path, task: str) -> None:
    config = load_config(None, {"pretrain.arch": "sapiens2_debug", "image_size": list(SIZE),
                                "evaluate.num_visualisations": 1})
    folder = model_dir(tmp_path / "models" / task, task)
    result, grid = evaluate_task(config, task, curated, folder, tmp_path, scratch_dir=folder)
    assert isinstance(result, TaskEvaluation) and result.num_images == 2 and grid.is_file()
    assert set(result.trivial) == {"seg": {"class_prior"}, "pose": {"mean_skeleton_in_box"}}[task]
    assert result.scratch == result.metrics  # the same weights scored as the from-scratch model
    assert (result.gate_baseline, result.gate_margin) == ("trivial", 0.02)
    tracked = _tracked_metrics(result)
    primary = result.primary_metric
    assert tracked[f"{task}.trivial.{result.strongest_trivial_name}.{primary}"] == result.strongest_trivial_value
    assert tracked[f"{task}.gate.passed"] == float(result.beats_baseline)
    assert f"{task}.scratch.{primary}" in tracked and f"{task}.baseline.{primary}" in tracked


def test_seg_prior_fitted_on_train_predicts_a_same_layout_val_split(curated: Path) -> None:
    """On these synthetic labels the per-pixel prior of train predicts val exactly (same layout)."""
    task = get_task("seg")
    train = CuratedDataset(curated, "train", *SIZE, tasks=("seg",), hflip_prob=0.0)
    val = CuratedDataset(curated, "val", *SIZE, tasks=("seg",))
    prior = fit_baselines("seg", task, batches(train, 3))["class_prior"]
    metrics, (images, outputs) = score_predictions(prior.predict, task, val, 1)
    assert metrics["aAcc"] == pytest.approx(1.0) and images.shape[0] == 1 and outputs[0].shape == SIZE


def test_scratch_dir_only_for_tasks_it_holds(tmp_path: Path) -> None:
    (tmp_path / "seg").mkdir()
    (tmp_path / "seg" / "model.json").write_text("{}")
    assert _scratch_dir(tmp_path, "seg") == tmp_path / "seg"
    assert _scratch_dir(tmp_path, "pose") is None and _scratch_dir(None, "seg") is None


def test_the_split_id_follows_the_val_files_bytes(tmp_path: Path, curated: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(curated, copy)
    original = split_id(CuratedDataset(curated, "val", *SIZE, tasks=()))
    assert split_id(CuratedDataset(copy, "val", *SIZE, tasks=())) == original  # same files elsewhere
    np.savez(copy / "labels" / "00000.npz", **make_labels(np.random.default_rng(9)))  # a train label
    assert split_id(CuratedDataset(copy, "val", *SIZE, tasks=())) == original
    np.savez(copy / "labels" / "00005.npz", **make_labels(np.random.default_rng(9)))  # relabelled val image
    assert split_id(CuratedDataset(copy, "val", *SIZE, tasks=())) != original
