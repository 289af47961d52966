"""Evaluation and registry groups: held-out evaluation, the baseline gate, MLflow registration,
promotion into the production registry, and the rollback job."""


import json

import dagster as dg
import mlflow
import pandas as pd
from pydantic import Field

from assets import metadata
from assets.curation import TRANSIENT
from assets.resources import WORKSPACE_WRITER, DvcResource, PlatformResource
from assets.training import finetuned_models, pretrained_backbone, scratch_models
from pipelines.common import tracking
from pipelines.common.config import TASK_NAMES
from pipelines.common.eval_report import REPORT_TAG, report_sha256
from pipelines.common.lineage import Lineage, dvc_hash
from pipelines.common.model_registry import Production, Request
from pipelines.promote import promote
from pipelines.register import evaluated_version, gated_out, register_all
from pipelines.rollback import rollback


@dg.asset(group_name="evaluation", deps=[*finetuned_models, *scratch_models], kinds={"pytorch", "mlflow", "dvc"})
def evaluation_report(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource) -> dg.MaterializeResult:
    """Every task's field-standard metric on the held-out split, beside its trivial baselines
    (fitted on train) and its untrained head."""
    ws, config = platform.ws, platform.config
    lineage = Lineage.from_env(ws.curated_dir, ws.pretrain_dir, context.run.run_id)
    from pipelines.evaluate import evaluate  # the training stack (DeepSpeed): loaded when the asset runs

    report = evaluate(config, ws.curated_dir, ws.root / "models", ws.eval_dir, lineage, ws.scratch_root)
    md5 = dvc.commit(ws, "evaluate", ws.eval_dir)
    return dg.MaterializeResult(
        metadata={
            "table": dg.MetadataValue.md((ws.eval_dir / "table.md").read_text()),
            "split_id": report["split_id"],
            "mlflow_run_id": _evaluation_run(platform),
            **{f"{name}_predictions": metadata.image(ws.eval_dir / f"{name}_predictions.png", name) for name in TASK_NAMES},
        },
        data_version=dg.DataVersion(md5),
    )


@dg.asset_check(asset=evaluation_report)
def every_task_beats_baseline(platform: PlatformResource) -> dg.AssetCheckResult:
    """Quality gate before registration: each fine-tuned task beats the configured gate baseline
    (`evaluate.gate_baseline`: the strongest trivial baseline by default, or the untrained head) by
    at least its `evaluate.gate_margin`, in the direction of its primary metric.

    The gate blocks per task: `registered_models` never registers a task that failed it, while the
    tasks that passed go on, so the check itself does not stop the run; it fails (ERROR) naming
    the tasks held back."""
    report = json.loads((platform.ws.eval_dir / "metrics.json").read_text())
    losing = [t["task"] for t in report["tasks"] if not t["beats_baseline"]]
    return dg.AssetCheckResult(passed=not losing, severity=dg.AssetCheckSeverity.ERROR, metadata={
        "not_beating_baseline": ", ".join(losing) or "none",
        "gate_baseline": report.get("gate_baseline", "untrained_head"),
        "gate_margin": ", ".join(f"{task} {m:g}" for task, m in report.get("gate_margin", {}).items()) or "none",
        **{f"{t['task']}_gate": t["gate"]["reason"] for t in report["tasks"] if "gate" in t},
    })


@dg.asset(group_name="registry", deps=[evaluation_report, pretrained_backbone], retry_policy=TRANSIENT, kinds={"mlflow"})
def registered_models(context: dg.AssetExecutionContext, platform: PlatformResource) -> dg.MaterializeResult:
    """Each task model as an MLflow pyfunc version with lineage and evaluation tags."""
    ws, config = platform.ws, platform.config
    report_file = ws.eval_dir / "metrics.json"
    report = json.loads(report_file.read_text())
    model_md5 = {task: dvc_hash(ws.task_dir(task), ws) for task in TASK_NAMES}
    registrations, refused = register_all(config, report_file, ws.root / "models", model_md5,
                                          Lineage.from_env(ws.curated_dir, ws.pretrain_dir, context.run.run_id))
    for task, reason in refused.items():
        context.log.warning(f"{task}: not registered, its gate failed: {reason}")
    rows = pd.DataFrame([{"model": r.model_name, "version": r.version, "reused": r.reused, "gate": "pass"} for r in registrations]
                        + [{"model": config.model_name(t), "version": "", "reused": False, "gate": reason} for t, reason in refused.items()])
    return dg.MaterializeResult(metadata={"versions": metadata.table(rows), "split_id": report["split_id"],
                                          "gated_out": ", ".join(refused) or "none"})


class PromoteConfig(dg.Config):
    reason: str = Field(default="end-to-end run", description="why this promotion was requested (recorded on the version)")
    requested_by: str = Field(default="", description="who asked for it (recorded); empty = the OS user running the step")


def _request(config: "PromoteConfig | RollbackConfig", context: dg.OpExecutionContext, evaluation_run: str = "") -> Request:
    who = {"requested_by": config.requested_by} if config.requested_by else {}
    return Request(reason=config.reason, evaluation_run=evaluation_run, dagster_run_id=context.run.run_id, **who)


def _dev_client(platform: PlatformResource) -> mlflow.MlflowClient:
    uri = tracking.tracking_uri_for(platform.ws.root)
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def _evaluation_run(platform: PlatformResource) -> str:
    """The MLflow run that logged the workspace's evaluation report, found by the report's hash."""
    sha = report_sha256(platform.ws.eval_dir / "metrics.json")
    return tracking.find_run("evaluation", REPORT_TAG, sha, _dev_client(platform))


@dg.asset(group_name="registry", deps=[registered_models], retry_policy=TRANSIENT, kinds={"mlflow"})
def champion_models(context: dg.AssetExecutionContext, config: PromoteConfig, platform: PlatformResource) -> dg.MaterializeResult:
    """Copies each task's evaluated version (the weights the report scored, found by their hash)
    into `<name>-production` as `champion`, only if it beats that champion on the same split."""
    ws, cfg = platform.ws, platform.config
    client = _dev_client(platform)
    report = json.loads((ws.eval_dir / "metrics.json").read_text())
    request = _request(config, context, evaluation_run=_evaluation_run(platform))
    rows = []
    refused = gated_out(report)
    for task in report["tasks"]:
        name = cfg.model_name(task["task"])
        if task["task"] in refused:
            rows.append({"model": name, "version": "", "promoted": False, "production": "",
                         "reason": f"not registered: gate failed: {refused[task['task']]}"})
            continue
        version = evaluated_version(client, name, task.get("model_sha256", ""), report["split_id"])
        if version is None:
            raise dg.Failure(f"{name}: no version holds the weights the evaluation report scored "
                             f"(model.sha256 {task.get('model_sha256', '')[:12] or 'missing'}); register them first")
        production = Production.for_model(name, client)
        decision = promote(name, version, task["primary_metric"], task["higher_is_better"], report["split_id"],
                           reason_prefix=f"[{config.reason}; dagster run {context.run.run_id}] ", client=client,
                           production=production, request=request)
        rows.append({"model": name, "version": version, "promoted": decision.promoted,
                     "production": f"{production.name} v{decision.production_version}" if decision.promoted else "",
                     "reason": decision.reason})
        context.log.info(f"{name} v{version}: {'promoted' if decision.promoted else 'refused'}: {decision.reason}")
    return dg.MaterializeResult(metadata={"decisions": metadata.table(pd.DataFrame(rows))})


class RollbackConfig(dg.Config):
    reason: str = Field(description="why the production champion is rolled back (recorded on both versions)")
    tasks: list[str] = Field(default=list(TASK_NAMES), description=f"tasks to roll back, some of {list(TASK_NAMES)}")
    requested_by: str = Field(default="", description="who asked for it (recorded); empty = the OS user running the step")


@dg.op(out=dg.Out(dg.Nothing))
def rollback_champions(context: dg.OpExecutionContext, config: RollbackConfig, platform: PlatformResource) -> None:
    """Make each task's production `previous` its `champion` again; fails naming a task that has no previous."""
    unknown = sorted(set(config.tasks) - set(TASK_NAMES))
    if unknown:
        raise dg.Failure(f"unknown tasks {unknown}; expected some of {list(TASK_NAMES)}")
    client = _dev_client(platform)
    rows = []
    for task in config.tasks:
        name = platform.config.model_name(task)
        result = rollback(Production.for_model(name, client), _request(config, context), dev_client=client)
        rows.append({"model": result.model, "champion": result.restored_version, "demoted": result.demoted_version,
                     "previous": result.previous_version or "none"})
        context.log.info(f"{result.model}: champion v{result.demoted_version} -> v{result.restored_version}")
    context.add_output_metadata({"rollbacks": metadata.table(pd.DataFrame(rows))})


@dg.job(name="rollback", tags=WORKSPACE_WRITER, description="Restore each task's previous production champion; the reason is recorded on the versions.")
def rollback_job():
    rollback_champions()
