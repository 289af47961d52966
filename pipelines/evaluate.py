"""Step: evaluate the five fine-tuned models on the held-out split, against honest baselines.

Each task's metric is computed from sufficient statistics over the `val` split, which no training
step reads. Beside the fine-tuned model it scores the task's trivial baselines (fitted on the
`train` split without flipping, `sapiens2.tasks.baselines`), the untrained head (the same backbone
with a freshly initialised, seeded head: the model fine-tuning started from) and, when given, a
model trained from scratch with the same budget. The gate (`EvaluateConfig.gate_baseline`,
`gate_margin`) decides `beats_baseline`. Outputs: `metrics.json` (naming each scored model by its
`model_sha256`), `table.md`, one prediction grid per task (image | label | fine-tuned | strongest trivial |
untrained head | from scratch), all logged to MLflow (`sapiens2/evaluation`, tagged with the
report's sha256 so registration finds the run from the report alone).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.common.config import TASK_NAMES, PlatformConfig, load_config
from pipelines.common.eval_report import REPORT_TAG, TaskEvaluation, markdown_table, report_sha256
from pipelines.common.task_models import initial_model, recorded_backbone
from pipelines.common.launch import intra_op_threads, threads_per_rank
from pipelines.common.lineage import Lineage, RankZeroTracker, model_sha256
from pipelines.common.plots import image_grid_png
from pipelines.common.serving import load_task_model
from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.tasks import Task, TaskModel, get_task
from sapiens2.tasks.baselines import fit_baselines

Predict = Callable[[dict[str, Any]], Any]
Scored = tuple[dict[str, float], tuple[np.ndarray, list]]


def split_id(data: CuratedDataset) -> str:
    """Names the evaluation split by what it holds: each id with the bytes of its image and label
    file. A relabelled or re-rendered val set gets a new id even where `dvc.lock` was not updated,
    and a split read from another copy of the same files keeps its id."""
    digest = hashlib.sha256()
    for sample_id, image_file in zip(data.ids, data.image_files):
        digest.update(f"{sample_id}\n".encode())
        for path in (data.root / "images" / image_file, data.root / "labels" / f"{sample_id}.npz"):
            if path.is_file():  # pretraining-only images carry no labels
                with open(path, "rb") as f:
                    digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


def _task(name: str, config: PlatformConfig) -> Task:
    settings = config.task_settings(name)
    if name == "pose":
        settings["flip_test"] = config.evaluate.flip_test
    return get_task(name, **settings)


def batches(data: Sequence[dict[str, Any]], batch_size: int) -> Iterator[dict[str, Any]]:
    """The split (a dataset or its loaded samples) in order, as collated batches."""
    for start in range(0, len(data), batch_size):
        yield collate([data[i] for i in range(start, min(start + batch_size, len(data)))])


@torch.no_grad()
def score_predictions(predict: Predict, task: Task, data: Sequence[dict[str, Any]], batch_size: int) -> Scored:
    """The task metric of `predict(batch)` over the whole split, plus the first batch's images and
    decoded outputs (for the prediction grid)."""
    metric, first = task.metric(), None
    for batch in batches(data, batch_size):
        pred = predict(batch)
        metric.update(pred, batch)
        if first is None:
            first = (batch["image_uint8"].numpy(), task.decode(pred))
    return metric.compute(), first


def score(model: TaskModel, task: Task, data: Sequence[dict[str, Any]], batch_size: int) -> Scored:
    """`score_predictions` of a model, with the task's test-time prediction (e.g. flip test)."""
    return score_predictions(lambda batch: task.predict(model, batch["image"]), task, data, batch_size)


def _dataset(config: PlatformConfig, curated_dir: Path, split: str, name: str) -> CuratedDataset:
    # No flip on either split: baselines fit the labels as they are, like the split they score.
    height, width = config.image_size
    return CuratedDataset(curated_dir, split, height, width, tasks=(name,), hflip_prob=0.0,
                          person_crop_padding=config.task(name).person_crop_padding, **config.dataset_keypoints())


def evaluate_task(config: PlatformConfig, name: str, curated_dir: Path, model_dir: Path, out_dir: Path,
                  scratch_dir: Path | None = None) -> tuple[TaskEvaluation, Path]:
    """Score task `name`'s model and its baselines on `val`; `scratch_dir` holds a from-scratch
    model to score too. Returns the evaluation and its prediction grid."""
    task, batch_size = _task(name, config), config.evaluate.batch_size
    split = _dataset(config, curated_dir, "val", name)
    # Every predictor (model, scratch, untrained head, each baseline) scores the same samples:
    # decoded once, not once per predictor (about 2,600 image and label reads of a demo's 3,700).
    val = [split[i] for i in range(len(split))]
    model, spec = load_task_model(model_dir)
    untrained = initial_model(config, name, recorded_backbone(spec, model_dir)).eval()
    fitted = fit_baselines(name, task, batches(_dataset(config, curated_dir, "train", name), batch_size))
    trivial = {b: score_predictions(baseline.predict, task, val, batch_size) for b, baseline in fitted.items()}
    tuned, head = score(model, task, val, batch_size), score(untrained, task, val, batch_size)
    scratch = score(load_task_model(scratch_dir)[0], task, val, batch_size) if scratch_dir else None
    result = TaskEvaluation(
        name, task.primary_metric, task.higher_is_better, tuned[0], head[0], len(val),
        trivial={b: metrics for b, (metrics, _) in trivial.items()}, scratch=scratch and scratch[0],
        gate_baseline=config.evaluate.gate_baseline, gate_margin=config.evaluate.gate_margin[name],
        model_sha256=model_sha256(model_dir),
    )
    columns = {"fine-tuned": tuned, f"trivial: {result.strongest_trivial_name}": trivial[result.strongest_trivial_name],
               "untrained head": head, **({"from scratch": scratch} if scratch else {})}
    images = tuned[1][0]
    shown = min(config.evaluate.num_visualisations, len(images))
    labels = task.decode_labels(collate(val[:shown]))
    rows = [[images[i], task.visualize(images[i], labels[i]),
             *(task.visualize(images[i], outputs[i]) for _, (_, outputs) in columns.values())] for i in range(shown)]
    grid = image_grid_png(rows, out_dir / f"{name}_predictions.png", col_titles=["image", "label", *columns])
    return result, grid


def _scratch_dir(scratch_root: Path | None, name: str) -> Path | None:
    """The task's from-scratch model folder, when `scratch_root` has one (else the column is "-")."""
    if scratch_root is None or not (scratch_root / name / "model.json").is_file():
        return None
    return scratch_root / name


def _tracked_metrics(r: TaskEvaluation) -> dict[str, float]:
    """MLflow metrics of one task: `<task>.<metric>`, `.baseline.` (untrained head),
    `.trivial.<name>.`, `.scratch.` and the gate's achieved margin and verdict."""
    out = {f"{r.task}.{k}": v for k, v in r.metrics.items()}
    out |= {f"{r.task}.baseline.{k}": v for k, v in r.baseline.items()}
    for baseline, metrics in r.trivial.items():
        out |= {f"{r.task}.trivial.{baseline}.{k}": v for k, v in metrics.items()}
    out |= {f"{r.task}.scratch.{k}": v for k, v in (r.scratch or {}).items()}
    return out | {f"{r.task}.gate.achieved_margin": r.margin, f"{r.task}.gate.passed": float(r.beats_baseline)}


def evaluate(config: PlatformConfig, curated_dir: Path, models_root: Path, output_dir: Path, lineage: Lineage,
             scratch_root: Path | None = None) -> dict:
    """Evaluate every task; returns the report dict also written to `metrics.json`.

    `scratch_root`, laid out like `models_root` (`<task>/model.json` + `model.safetensors`), fills
    the from-scratch column for the tasks it holds.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    height, width = config.image_size
    sid = split_id(CuratedDataset(curated_dir, "val", height, width, tasks=()))
    results, grids = [], []
    # Evaluation runs in Dagster's step process and as its own CLI process: the same thread count
    # either way, so both routes write the same report bytes. It is a training program's count (one
    # thread on 2 cores), not every core: at two threads a process's first elementwise op sometimes
    # comes out thousands of ulps off (README, Known limits), which moved the pose baseline's AP
    # by 0.0008 between two demo runs of one commit. At one thread the evaluation CLI took 1.3x as long.
    with intra_op_threads(threads_per_rank(1)), \
            RankZeroTracker(0, "evaluation", lineage, config.to_dict(), run_name="evaluation") as tracker:
        for name in TASK_NAMES:
            print(f"[evaluate] {name} ...", flush=True)
            result, grid = evaluate_task(config, name, curated_dir, models_root / name, output_dir,
                                         _scratch_dir(scratch_root, name))
            results.append(result)
            grids.append(grid)
            tracker.log_metrics(_tracked_metrics(result), 0)
        table = markdown_table(results)
        (output_dir / "table.md").write_text(table + "\n")
        report = {"split_id": sid, "data_md5": lineage.data_md5, "gate_baseline": config.evaluate.gate_baseline,
                  "gate_margin": dict(config.evaluate.gate_margin), "tasks": [r.to_report() for r in results]}
        report_file = output_dir / "metrics.json"
        report_file.write_text(json.dumps(report, indent=2, default=float))
        tracker.set_tags({REPORT_TAG: report_sha256(report_file)})
        tracker.log_artifacts([output_dir / "table.md", report_file])
        tracker.log_artifacts(grids, artifact_path="predictions")
    print(table, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 once the report is written, whatever the gate decided: the gate holds back
    each failing task at registration (`sapiens2 register`), and a nonzero status would stop
    `dvc repro` from recording the very report that says why."""
    parser = argparse.ArgumentParser(prog="sapiens2 evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--curated", type=Path, required=True)
    parser.add_argument("--models", type=Path, required=True, help="folder holding one sub-folder per task")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--scratch-models", type=Path, default=None,
                        help="optional folder like --models with from-scratch models (same budget) to score too")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    report = evaluate(config, args.curated, args.models, args.output, Lineage.from_env(args.curated),
                      scratch_root=args.scratch_models)
    for task in report["tasks"]:
        print(f"[evaluate] {task['task']}: gate {'pass' if task['beats_baseline'] else 'FAIL'}: {task['gate']['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
