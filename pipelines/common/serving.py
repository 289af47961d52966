"""A fine-tuned task model as an MLflow pyfunc: an image batch in, the task's output out.

Input: RGB images (N, H, W, 3) of 0-255 pixel values (uint8, or whole numbers in a float array:
the served signature is float32 so that JSON values arrive as sent; a uint8 schema would cast
floats in [0, 1] to zeros and answer 200), at most `MAX_IMAGES` per request and `MAX_SIDE` pixels
a side; images of another size are resized to the model's input size and keypoints are mapped
back to the caller's pixels. Output per task: pose (N, K, 3) x, y,
score; seg (N, H, W) class ids; normal (N, H, W, 3) unit vectors; pointmap (N, H, W, 3) metres (zero off the
predicted silhouette where the head predicts one);
albedo (N, H, W, 3) in [0, 1]. Dense outputs come at the model's input size.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import mlflow.pyfunc
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
import numpy as np
import torch
import torch.nn.functional as F

from sapiens2.data.normalize import normalize_images
from sapiens2.model import build_backbone, load_checkpoint
from sapiens2.tasks import TaskModel, build_task_model, get_task


def load_task_model(model_dir: Path) -> tuple[TaskModel, dict]:
    """Rebuild a fine-tuned model from its folder (model.json + model.safetensors), in eval mode."""
    spec = json.loads((Path(model_dir) / "model.json").read_text())
    backbone = build_backbone(spec["arch"], img_size=tuple(spec["image_size"]))
    model = build_task_model(spec["task"], backbone, **spec.get("task_settings", {}))
    load_checkpoint(model, Path(model_dir) / "model.safetensors")
    return model.eval(), spec


MAX_IMAGES, MAX_SIDE = 64, 4096  # one request's bound on memory and on a CPU replica's time


def checked_images(images: np.ndarray) -> np.ndarray:
    """The request as uint8 (N, H, W, 3), or a ValueError saying what is wrong with it."""
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected images of shape (N, H, W, 3), got {images.shape}")
    n, height, width = images.shape[:3]
    if not 1 <= n <= MAX_IMAGES or not (1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE):
        raise ValueError(f"{n} images of {height}x{width}: a request holds 1-{MAX_IMAGES} images of at most "
                         f"{MAX_SIDE} px a side")
    if images.dtype == np.uint8:
        return images
    if images.dtype.kind not in "fiu":
        raise ValueError(f"expected pixel values 0-255, got dtype {images.dtype}")
    if not np.all(np.isfinite(images)) or images.min() < 0 or images.max() > 255 or np.any(images != np.round(images)):
        hint = " (floats in [0, 1]? multiply by 255)" if images.min() >= 0 and images.max() <= 1 else ""
        raise ValueError(f"expected whole pixel values 0-255, got values from {images.min()} to {images.max()}{hint}")
    return images.astype(np.uint8)


def predict_images(model: TaskModel, task_name: str, images: np.ndarray, size: tuple[int, int],
                   task_settings: dict | None = None) -> np.ndarray:
    """Run `model` on images (N, H, W, 3) of 0-255 values (`checked_images`) and stack the task's
    decoded outputs; `task_settings` are those the model was fine-tuned with (its model.json)."""
    images = checked_images(np.asarray(images))
    task = get_task(task_name, **(task_settings or {}))
    pixels = torch.from_numpy(np.ascontiguousarray(images))
    height, width = images.shape[1:3]
    if (height, width) != tuple(size):
        chw = pixels.permute(0, 3, 1, 2).float()
        pixels = F.interpolate(chw, size=size, mode="bilinear", align_corners=False).round().clamp(0, 255).byte().permute(0, 2, 3, 1)
    with torch.no_grad():
        outputs = np.stack(task.decode(task.predict(model, normalize_images(pixels))))
    if task_name == "pose":
        outputs[..., 0] *= width / size[1]
        outputs[..., 1] *= height / size[0]
    return outputs


# The distributions the served code imports (tests/unit/test_serving_requirements.py reads its
# imports): the project itself travels as the model's code, so it is not one of them. Declared,
# not inferred: MLflow's inference loads each model in a subprocess (3.6 s a model here) and
# drops torch and the rest as dependencies of sapiens2-platform, which no package index has.
SERVED_DISTRIBUTIONS = ("mlflow", "cloudpickle", "torch", "numpy", "pandas", "pillow", "opencv-python-headless",
                        "pycocotools", "safetensors")


def served_requirements() -> list[str]:
    """`SERVED_DISTRIBUTIONS` pinned to the versions installed here, without local labels such as
    `+cpu` (PyPI's torch==2.13.0 is the same release)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in SERVED_DISTRIBUTIONS]


class TaskPyfunc(mlflow.pyfunc.PythonModel):
    """Loads `model_dir` (artifact) once; `predict` maps an image batch to the task output."""

    def load_context(self, context: Any) -> None:
        self.model, self.spec = load_task_model(Path(context.artifacts["model_dir"]))

    def predict(self, context: Any, model_input: np.ndarray, params: dict | None = None) -> np.ndarray:
        try:
            images = checked_images(np.asarray(model_input))
        except ValueError as exc:  # MLflow answers an MlflowException with its message and a 400
            raise MlflowException(str(exc), error_code=INVALID_PARAMETER_VALUE) from None
        return predict_images(self.model, self.spec["task"], images, tuple(self.spec["image_size"]),
                              self.spec.get("task_settings"))
