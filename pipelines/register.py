"""Step: register each fine-tuned task model in MLflow as a pyfunc with lineage and evaluation tags.

Registered name `<prefix>-<task>`. Version tags: `dagster_run_id`, `dvc.data_md5`,
`dvc.backbone_md5`, `dvc.model_md5`, `git_commit`, `config_sha`, `eval.<metric>` for every metric,
`eval.split_id`, `eval.primary_metric`, `eval.baseline.<metric>` (untrained head), the primary
value of each trivial baseline `eval.trivial.<name>.<primary>` with `eval.trivial.strongest`, and the
gate (`eval.gate.passed` true/false, `.baseline`, `.baseline_value`, `.margin`, `.reason`), which
promotion refuses to overrule. A task that failed its gate is not registered (`gated_out`).
Registering the same model files (same `dvc.model_md5`)
evaluated on the same split again returns the existing version instead of adding a duplicate.
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
from pipelines.common.lineage import Lineage, dvc_hash
from pipelines.common.model_registry import GATE_PASSED_TAG, GATE_REASON_TAG
from pipelines.common.serving import TaskPyfunc, load_task_model, predict_images
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


def _existing_version(client: MlflowClient, name: str, model_md5: str, split: str) -> str | None:
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        return None
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get("dvc.model_md5") == model_md5 and mv.tags.get("eval.split_id") == split:
            return str(mv.version)
    return None


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
                  lineage: Lineage) -> Registration:
    task = task_result["task"]
    name = config.model_name(task)
    client = MlflowClient()
    tags = {
        **lineage.tags(config.to_dict()),
        "dvc.model_md5": model_md5,
        "eval.split_id": split,
        "eval.primary_metric": task_result["primary_metric"],
        **{f"eval.{k}": str(v) for k, v in task_result["metrics"].items()},
        **{f"eval.baseline.{k}": str(v) for k, v in task_result["baseline"].items()},
        **gate_tags(task_result),
    }
    existing = _existing_version(client, name, model_md5, split)
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
            for item in ("model.json", "model.safetensors"):
                shutil.copy2(model_dir / item, files / item)
            info = mlflow.pyfunc.log_model(
                name="model", python_model=TaskPyfunc(), artifacts={"model_dir": str(files)},
                code_paths=[str(Path(sapiens2.__file__).parent), str(Path(pipelines.__file__).parent)],
                signature=signature, registered_model_name=name, tags=tags,
            )
        # The tags are part of the version's creation: a version without its dvc.model_md5 (that a
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


def register_all(config: PlatformConfig, report: dict, models_root: Path, model_md5: dict[str, str],
                 lineage: Lineage) -> tuple[list[Registration], dict[str, str]]:
    """Register every task of an evaluation report (`metrics.json`) that passed its gate;
    returns the registrations and the gated-out tasks with their reasons."""
    uri = tracking.tracking_uri_for(Workspace.from_env().root)
    tracking.require_server(uri)
    mlflow.set_tracking_uri(uri)
    refused = gated_out(report)
    registrations = [
        register_task(config, result, report["split_id"], models_root / result["task"], model_md5[result["task"]], lineage)
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
    report = json.loads(args.report.read_text())
    registrations, refused = register_all(load_config(args.config), report, args.models, md5, lineage)
    for reg in registrations:
        print(f"{reg.model_name} v{reg.version}{' (already registered)' if reg.reused else ''}")
    for task, reason in refused.items():
        print(f"{task}: not registered, gate failed: {reason}")
    return 0
