"""Step: register each fine-tuned task model in MLflow as a pyfunc with lineage and evaluation tags.

Registered name `<prefix>-<task>`. Version tags: `dagster_run_id`, `dvc.data_md5`,
`dvc.backbone_md5`, `dvc.model_md5`, `git_commit`, `config_sha`, `eval.<metric>` for every metric,
`eval.split_id`, `eval.primary_metric`, `eval.baseline.<metric>` (untrained head), the primary
value of each trivial baseline `eval.trivial.<name>.<primary>` with `eval.trivial.strongest`, and the
gate (`eval.gate.passed` true/false, `.baseline`, `.baseline_value`, `.margin`, `.reason`), which
promotion refuses to overrule. A task that failed its gate is not registered (`gated_out`).

A version is the weights the report scored, identified by their hash: registration refuses a
model folder whose files no longer hash to the report's `model_sha256` (another run overwrote
them after evaluation), tags the version `model.sha256` and `eval.report_sha256`, and registering
the same weights evaluated on the same split again returns the existing version (`evaluated_version`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
from mlflow import MlflowClient
from mlflow.models import ModelSignature, infer_signature
from mlflow.types import Schema, TensorSpec

import pipelines
import sapiens2
from pipelines.common import tracking
from pipelines.common.config import TASK_NAMES, PlatformConfig, load_config
from pipelines.common.eval_report import REPORT_TAG, report_sha256
from pipelines.common.lineage import MODEL_FILES, Lineage, dvc_hash, model_sha256
from pipelines.common.model_registry import GATE_PASSED_TAG, GATE_REASON_TAG, MODEL_SHA_TAG, SPLIT_TAG
from pipelines.common.serving import TaskPyfunc, load_task_model, predict_images, served_requirements
from pipelines.common.workspace import Workspace


@dataclass(frozen=True)
class Registration:
    task: str
    model_name: str
    version: str
    primary_metric: str
    higher_is_better: bool
    split_id: str
    reused: bool


class EvaluatedWeightsChanged(ValueError):
    """A model folder no longer holds the weights its evaluation report scored."""


def evaluated_version(client: MlflowClient, name: str, weights_sha256: str, split: str) -> str | None:
    """The version of `name` holding exactly these weights evaluated on `split`, if registered."""
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        return None
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get(MODEL_SHA_TAG) == weights_sha256 and mv.tags.get(SPLIT_TAG) == split:
            return str(mv.version)
    return None


def check_evaluated_weights(task_result: dict, model_dir: Path) -> str:
    """The sha256 of `model_dir`'s weights, when they are the ones `task_result` scored."""
    evaluated = task_result.get("model_sha256")
    if not evaluated:
        raise EvaluatedWeightsChanged(f"{task_result['task']}: the evaluation report names no model_sha256 "
                                      "(written before reports named their weights); evaluate again")
    current = model_sha256(model_dir)
    if current != evaluated:
        raise EvaluatedWeightsChanged(
            f"{model_dir}: its weights (sha256 {current[:12]}) are not the ones the evaluation report scored "
            f"(model_sha256 {evaluated[:12]}): another run replaced them after evaluation; evaluate again")
    return current


def gate_tags(task_result: dict) -> dict[str, str]:
    """Tags of the trivial baselines and the gate; none for a report written before the gate."""
    primary = task_result["primary_metric"]
    tags = {f"eval.trivial.{name}.{primary}": str(m[primary]) for name, m in task_result.get("trivial", {}).items()}
    if task_result.get("strongest_trivial"):
        tags["eval.trivial.strongest"] = task_result["strongest_trivial"]
    gate = task_result.get("gate")
    if gate:
        tags |= {GATE_PASSED_TAG: "true" if gate["passed"] else "false", "eval.gate.baseline": gate["baseline"],
                 "eval.gate.baseline_value": str(gate["baseline_value"]), "eval.gate.margin": str(gate["margin"]),
                 GATE_REASON_TAG: gate["reason"]}
    return tags


def register_task(config: PlatformConfig, task_result: dict, split: str, model_dir: Path, model_md5: str,
                  lineage: Lineage, report_sha: str = "") -> Registration:
    task = task_result["task"]
    name = config.model_name(task)
    client = MlflowClient()
    weights = check_evaluated_weights(task_result, model_dir)
    tags = {
        **lineage.tags(config.to_dict()),
        "dvc.model_md5": model_md5,
        MODEL_SHA_TAG: weights,
        REPORT_TAG: report_sha,
        SPLIT_TAG: split,
        "eval.primary_metric": task_result["primary_metric"],
        **{f"eval.{k}": str(v) for k, v in task_result["metrics"].items()},
        **{f"eval.baseline.{k}": str(v) for k, v in task_result["baseline"].items()},
        **gate_tags(task_result),
    }
    existing = evaluated_version(client, name, weights, split)
    if existing is None:
        model, spec = load_task_model(model_dir)
        example = np.zeros((1, *spec["image_size"], 3), dtype=np.uint8)
        output = predict_images(model, task, example, tuple(spec["image_size"]), spec.get("task_settings"))
        # Any image size is served (the pyfunc resizes), so only the channel axis is fixed in the input.
        # float32, not uint8: MLflow casts a request's JSON values to the schema's dtype, and floats
        # in [0, 1] cast to uint8 are zeros; the model checks for 0-255 values (serving.checked_images).
        signature = ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1, -1, 3))]),
                                   outputs=infer_signature(example, output).outputs)
        with tempfile.TemporaryDirectory() as tmp, tracking.start_stage_run("registry", f"register-{task}", tags):
            files = Path(tmp) / "model"
            files.mkdir()
            for item in MODEL_FILES:
                shutil.copy2(model_dir / item, files / item)
            info = mlflow.pyfunc.log_model(
                name="model", python_model=TaskPyfunc(), artifacts={"model_dir": str(files)},
                code_paths=[str(Path(sapiens2.__file__).parent), str(Path(pipelines.__file__).parent)],
                signature=signature, pip_requirements=served_requirements(), registered_model_name=name, tags=tags,
            )
        # The tags are part of the version's creation: a version without its model.sha256 (that a
        # rerun could not recognise) never exists.
        existing = str(info.registered_model_version)
        reused = False
    else:
        reused = True
    return Registration(task, name, existing, task_result["primary_metric"], task_result["higher_is_better"], split, reused)


def gated_out(report: dict) -> dict[str, str]:
    """Tasks of an evaluation report that failed their gate, with the gate's reason: the gate
    blocks each task on its own, so one model that learned nothing holds back only itself."""
    # A report written before the gate carries no verdict: its tasks are registered as before.
    return {t["task"]: t.get("gate", {}).get("reason", "did not beat its baseline")
            for t in report["tasks"] if not t.get("beats_baseline", True)}


def register_all(config: PlatformConfig, report_file: Path, models_root: Path, model_md5: dict[str, str],
                 lineage: Lineage) -> tuple[list[Registration], dict[str, str]]:
    """Register every task of an evaluation report (`metrics.json`) that passed its gate;
    returns the registrations and the gated-out tasks with their reasons."""
    uri = tracking.tracking_uri_for(Workspace.from_env().root)
    tracking.require_server(uri)
    tracking.use_tracking_uri(uri)
    report, report_sha = json.loads(Path(report_file).read_text()), report_sha256(report_file)
    refused = gated_out(report)
    registrations = [
        register_task(config, result, report["split_id"], models_root / result["task"], model_md5[result["task"]],
                      lineage, report_sha)
        for result in report["tasks"] if result["task"] not in refused
    ]
    return registrations, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 register", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=Path("reports/eval/metrics.json"))
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--curated", type=Path, default=Path("data/curated"))
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    lineage = Lineage.from_env(args.curated, args.models / "pretrain")
    md5 = {task: dvc_hash(args.models / task) for task in TASK_NAMES}
    registrations, refused = register_all(load_config(args.config), args.report, args.models, md5, lineage)
    for reg in registrations:
        print(f"{reg.model_name} v{reg.version}{' (already registered)' if reg.reused else ''}")
    for task, reason in refused.items():
        print(f"{task}: not registered, gate failed: {reason}")
    return 0
