"""`sapiens2 predict`: run a fine-tuned task model on image files; write overlays and raw outputs.

--model is a model folder (model.json + model.safetensors, as fine-tuning writes it) or a
registry URI `models:/<name>@<alias>` / `models:/<name>/<version>`, downloaded through MLflow
(the registered pyfunc carries that folder as its `model_dir` artifact). For each image
`<stem>` the output folder gets `<stem>.<task>.png`, the task's own rendering (skeleton, part
colours, normal map, depth colour map, albedo), and the raw output: `<stem>.pose.json` with
keypoints x, y, score in the image's pixels, or `<stem>.<task>.npy` at the model's input size
(seg class ids, unit normals, pointmap in metres, albedo in [0, 1]) with the overlay drawn on
the image resized to that size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import cv2
import mlflow
import numpy as np

from pipelines.common import tracking
from pipelines.common.serving import load_task_model, predict_images
from pipelines.common.workspace import Workspace
from sapiens2.data.formats.common import read_rgb, write_png
from sapiens2.labels.keypoint_sets import get_keypoint_set
from sapiens2.tasks import TASK_NAMES, get_task


def resolve_model_dir(model: str, download_dir: Path) -> Path:
    """The local model folder for a folder path or a models:/ registry URI."""
    if model.startswith("models:/"):
        tracking.use_tracking_uri(tracking.tracking_uri_for(Workspace.from_env().root))
        local = Path(
            mlflow.artifacts.download_artifacts(artifact_uri=model, dst_path=str(download_dir))
        )
        folders = sorted(p.parent for p in local.rglob("model.json")
                         if (p.parent / "model.safetensors").is_file())
        if not folders:
            raise ValueError(f"{model}: no model.json + model.safetensors in its artifacts")
        return folders[0]
    folder = Path(model)
    for name in ("model.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ValueError(f"{folder / name}: missing model file")
    return folder


def predict_files(
    model_dir: Path, task_name: str, images: Sequence[Path], output_dir: Path
) -> list[Path]:
    """Predict every image with the model in `model_dir`; returns the files written."""
    model, spec = load_task_model(model_dir)
    if spec["task"] != task_name:
        raise ValueError(f"{model_dir / 'model.json'}: field 'task' is {spec['task']!r}, "
                         f"not {task_name!r}")
    stems = [Path(p).stem for p in images]
    if len(set(stems)) != len(stems):
        raise ValueError(f"images share a file name; outputs are named by it: {sorted(stems)}")
    settings = spec.get("task_settings") or {}
    task, size = get_task(task_name, **settings), tuple(spec["image_size"])
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path, stem in zip(images, stems, strict=True):
        image = read_rgb(Path(path))
        output = predict_images(model, task_name, image[None], size, settings)[0]
        if task_name == "pose":
            canvas, raw = image, output_dir / f"{stem}.pose.json"
            names = get_keypoint_set(task.keypoint_set).names
            names = names if len(names) == len(output) else None
            raw.write_text(json.dumps({
                "image": str(path), "keypoints": output.tolist(),
                "names": list(names) if names else None, "columns": ["x", "y", "score"],
            }, indent=1))
        else:
            canvas = cv2.resize(image, (size[1], size[0]), interpolation=cv2.INTER_AREA)
            raw = output_dir / f"{stem}.{task_name}.npy"
            np.save(raw, output)
        overlay = output_dir / f"{stem}.{task_name}.png"
        write_png(overlay, task.visualize(canvas, output))
        written += [overlay, raw]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--model", required=True, help="model folder or models:/<name>@<alias>")
    parser.add_argument("images", nargs="+", type=Path, metavar="IMAGE")
    parser.add_argument("--output", type=Path, default=Path("predictions"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sapiens2-model-") as tmp:
        model_dir = resolve_model_dir(args.model, Path(tmp))
        written = predict_files(model_dir, args.task, args.images, args.output)
    print(f"wrote {len(written)} files for {len(args.images)} images to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
