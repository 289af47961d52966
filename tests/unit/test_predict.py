"""`sapiens2 predict` on a debug-size model folder (and through a models:/ registry URI)."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from pipelines.cli import main as cli
from pipelines.common.serving import load_task_model, predict_images
from sapiens2.model import build_backbone, save_checkpoint
from sapiens2.tasks import TASK_NAMES, build_task_model

SIZE = (64, 48)


def make_model_dir(folder: Path, task: str) -> Path:
    """The files fine-tuning writes: model.safetensors and model.json (debug backbone)."""
    torch.manual_seed(0)
    model = build_task_model(task, build_backbone("sapiens2_debug", img_size=SIZE))
    save_checkpoint(model, folder / "model.safetensors")
    spec = {"task": task, "arch": "sapiens2_debug", "image_size": list(SIZE), "task_settings": {}}
    (folder / "model.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture
def images(tmp_path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for name, shape in (("a", (80, 60, 3)), ("b", (*SIZE, 3))):
        path = tmp_path / "in" / f"{name}.png"
        path.parent.mkdir(exist_ok=True)
        cv2.imwrite(str(path), rng.integers(0, 256, shape, dtype=np.uint8))
        paths.append(path)
    return paths


@pytest.mark.parametrize("task", TASK_NAMES)
def test_predict_writes_overlay_and_raw_output(tmp_path, images, task):
    model_dir = make_model_dir(tmp_path / "model", task)
    out = tmp_path / "out"
    args = ["predict", "--task", task, "--model", str(model_dir), *map(str, images)]
    assert cli([*args, "--output", str(out)]) == 0
    model, spec = load_task_model(model_dir)
    image = cv2.imread(str(images[0]))[..., ::-1].copy()
    expected = predict_images(model, task, image[None], SIZE)[0]
    overlay = cv2.imread(str(out / f"a.{task}.png"))
    if task == "pose":
        raw = json.loads((out / "a.pose.json").read_text())
        assert np.allclose(raw["keypoints"], expected, atol=1e-5)
        assert len(raw["names"]) == 17
        assert overlay.shape == image.shape  # drawn on the caller's image
    else:
        raw = np.load(out / f"a.{task}.npy")
        assert raw.shape[:2] == SIZE and np.allclose(raw, expected, atol=1e-6)
        assert overlay.shape == (*SIZE, 3)
    assert (out / f"b.{task}.png").is_file()
    if task == "seg":
        assert raw.max() < 29
    if task == "normal":
        assert np.allclose(np.linalg.norm(raw, axis=-1), 1.0, atol=1e-4)
    if task == "albedo":
        assert 0.0 <= raw.min() and raw.max() <= 1.0


def test_predict_rejects_a_model_of_another_task(tmp_path, images):
    model_dir = make_model_dir(tmp_path / "model", "seg")
    with pytest.raises(ValueError, match=r"model\.json: field 'task' is 'seg', not 'normal'"):
        cli(["predict", "--task", "normal", "--model", str(model_dir), str(images[0])])
    with pytest.raises(ValueError, match=r"nowhere/model\.json: missing model file"):
        cli(["predict", "--task", "seg", "--model", str(tmp_path / "nowhere"), str(images[0])])


@pytest.fixture
def restore_tracking_uri():
    previous = mlflow.get_tracking_uri()
    yield
    mlflow.set_tracking_uri(previous)


def test_predict_from_a_registry_alias(tmp_path, images, monkeypatch, restore_tracking_uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    model_dir = make_model_dir(tmp_path / "model", "normal")
    experiment = mlflow.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        # where register.py's pyfunc keeps the folder: <model>/artifacts/model/
        mlflow.log_artifacts(str(model_dir), "model/artifacts/model")
    client = MlflowClient()
    client.create_registered_model("sapiens2-normal")
    version = client.create_model_version(
        "sapiens2-normal", f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )
    client.set_registered_model_alias("sapiens2-normal", "champion", version.version)
    out = tmp_path / "out"
    assert cli(["predict", "--task", "normal", "--model", "models:/sapiens2-normal@champion",
                str(images[1]), "--output", str(out)]) == 0
    direct = tmp_path / "direct"
    cli(["predict", "--task", "normal", "--model", str(model_dir), str(images[1]),
         "--output", str(direct)])
    assert np.array_equal(np.load(out / "b.normal.npy"), np.load(direct / "b.normal.npy"))


def test_served_requests_hold_whole_pixel_values_and_bounded_sizes() -> None:
    from pipelines.common.serving import MAX_IMAGES, checked_images

    pixels = np.arange(2 * 4 * 4 * 3).reshape(2, 4, 4, 3) % 256
    assert checked_images(pixels.astype(np.float32)).dtype == np.uint8
    np.testing.assert_array_equal(checked_images(pixels.astype(np.float32)), pixels.astype(np.uint8))
    with pytest.raises(ValueError, match="multiply by 255"):
        checked_images(pixels.astype(np.float32) / 255.0)
    with pytest.raises(ValueError, match="values from -1"):
        checked_images(np.full((1, 4, 4, 3), -1.0))
    with pytest.raises(ValueError, match=f"1-{MAX_IMAGES} images"):
        checked_images(np.zeros((MAX_IMAGES + 1, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="px a side"):
        checked_images(np.zeros((1, 5000, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"shape \(N, H, W, 3\)"):
        checked_images(np.zeros((1, 4, 4, 4), np.uint8))
