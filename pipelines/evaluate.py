"""Step: evaluate the five fine-tuned models on the held-out split, against untrained-head baselines.

Each task's metric is computed from sufficient statistics over the `val` split, which no training
step reads. The baseline is the model fine-tuning started from: the same backbone weights with a
freshly initialised (seeded) head. Outputs: `metrics.json`, `table.md`, one prediction grid per
task (image | fine-tuned | untrained head), all logged to MLflow (`sapiens2/evaluation`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipelines.config import TASK_NAMES, PlatformConfig, load_config
from pipelines.finetune import initial_model
from pipelines.lineage import Lineage, RankZeroTracker
from pipelines.plots import image_grid_png
from pipelines.serving import load_task_model
from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.tasks import Task, TaskModel, get_task


@dataclass(frozen=True)
class TaskEvaluation:
    task: str
    primary_metric: str
    higher_is_better: bool
    metrics: dict[str, float]
    baseline: dict[str, float]
    num_images: int

    @property
    def value(self) -> float:
        return self.metrics[self.primary_metric]

    @property
    def baseline_value(self) -> float:
        return self.baseline[self.primary_metric]

    @property
    def beats_baseline(self) -> bool:
        if self.higher_is_better:
            return self.value > self.baseline_value
        return self.value < self.baseline_value


def split_id(data: CuratedDataset, data_md5: str) -> str:
    """Names the evaluation split: the dataset version plus the exact ids in it."""
    digest = hashlib.sha256("\n".join([data_md5, *data.ids]).encode()).hexdigest()
    return digest[:16]


def _task(name: str, config: PlatformConfig) -> Task:
    settings = config.task_settings(name)
    if name == "pose":
        settings["flip_test"] = config.evaluate.flip_test
    return get_task(name, **settings)


@torch.no_grad()
def score(model: TaskModel, task: Task, data: CuratedDataset, batch_size: int) -> tuple[dict[str, float], list]:
    """The task metric over the whole split, plus the decoded outputs of the first batch."""
    metric, first = task.metric(), None
    for start in range(0, len(data), batch_size):
        batch = collate([data[i] for i in range(start, min(start + batch_size, len(data)))])
        pred = task.predict(model, batch["image"])
        metric.update(pred, batch)
        if first is None:
            first = (batch["image_uint8"].numpy(), task.decode(pred))
    return metric.compute(), first


def evaluate_task(config: PlatformConfig, name: str, curated_dir: Path, model_dir: Path, out_dir: Path) -> tuple[TaskEvaluation, Path]:
    task = _task(name, config)
    height, width = config.image_size
    data = CuratedDataset(curated_dir, "val", height, width, tasks=(name,), **config.dataset_keypoints())
    model, spec = load_task_model(model_dir)
    baseline_model = initial_model(config, name, Path(spec["backbone_init"])).eval()
    metrics, (images, outputs) = score(model, task, data, config.evaluate.batch_size)
    baseline, (_, baseline_outputs) = score(baseline_model, task, data, config.evaluate.batch_size)
    n = min(config.evaluate.num_visualisations, len(images))
    rows = [[images[i], task.visualize(images[i], outputs[i]), task.visualize(images[i], baseline_outputs[i])] for i in range(n)]
    grid = image_grid_png(rows, out_dir / f"{name}_predictions.png", col_titles=["image", "fine-tuned", "untrained head"])
    result = TaskEvaluation(name, task.primary_metric, task.higher_is_better, metrics, baseline, len(data))
    return result, grid


def markdown_table(results: list[TaskEvaluation]) -> str:
    lines = ["| task | metric | fine-tuned | untrained head | beats baseline | val images |", "|---|---|---|---|---|---|"]
    for r in results:
        arrow = "higher" if r.higher_is_better else "lower"
        lines.append(f"| {r.task} | {r.primary_metric} ({arrow} is better) | {r.value:.4f} | {r.baseline_value:.4f} "
                     f"| {'yes' if r.beats_baseline else 'NO'} | {r.num_images} |")
    return "\n".join(lines)


def evaluate(config: PlatformConfig, curated_dir: Path, models_root: Path, output_dir: Path, lineage: Lineage) -> dict:
    """Evaluate every task; returns the report dict also written to `metrics.json`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    height, width = config.image_size
    sid = split_id(CuratedDataset(curated_dir, "val", height, width, tasks=()), lineage.data_md5)
    results, grids = [], []
    with RankZeroTracker(0, "evaluation", lineage, config.to_dict(), run_name="evaluation") as tracker:
        for name in TASK_NAMES:
            print(f"[evaluate] {name} ...", flush=True)
            result, grid = evaluate_task(config, name, curated_dir, models_root / name, output_dir)
            results.append(result)
            grids.append(grid)
            tracker.log_metrics({f"{name}.{k}": v for k, v in result.metrics.items()}, 0)
            tracker.log_metrics({f"{name}.baseline.{k}": v for k, v in result.baseline.items()}, 0)
        table = markdown_table(results)
        (output_dir / "table.md").write_text(table + "\n")
        report = {"split_id": sid, "data_md5": lineage.data_md5, "tasks": [asdict(r) | {"beats_baseline": r.beats_baseline} for r in results],
                  "mlflow_run_id": tracker.run_id}
        (output_dir / "metrics.json").write_text(json.dumps(report, indent=2, default=float))
        tracker.log_artifacts([output_dir / "table.md", output_dir / "metrics.json"])
        tracker.log_artifacts(grids, artifact_path="predictions")
    print(table, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--curated", type=Path, required=True)
    parser.add_argument("--models", type=Path, required=True, help="folder holding one sub-folder per task")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    config = load_config(args.config)
    report = evaluate(config, args.curated, args.models, args.output, Lineage.from_env(args.curated))
    return 0 if all(t["beats_baseline"] for t in report["tasks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
