"""Evaluation and registry groups: held-out evaluation, the baseline gate, MLflow registration, promotion."""


import json

import dagster as dg
import mlflow
import pandas as pd
from pydantic import Field

from assets import metadata
from assets.curation import TRANSIENT
from assets.resources import DvcResource, PlatformResource
from assets.training import finetuned_models, pretrained_backbone
from pipelines import tracking
from pipelines.config import TASK_NAMES
from pipelines.evaluate import evaluate
from pipelines.lineage import Lineage, dvc_hash
from pipelines.promote import promote
from pipelines.register import register_all


@dg.asset(group_name="evaluation", deps=finetuned_models, kinds={"pytorch", "mlflow", "dvc"})
def evaluation_report(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource) -> dg.MaterializeResult:
    """Every task's field-standard metric on the held-out split, beside its untrained-head baseline."""
    ws, config = platform.ws, platform.config
    lineage = Lineage.from_env(ws.curated_dir, ws.pretrain_dir)
    report = evaluate(config, ws.curated_dir, ws.root / "models", ws.eval_dir, lineage)
    md5 = dvc.commit(ws, "evaluate", ws.eval_dir)
    return dg.MaterializeResult(
        metadata={
            "table": dg.MetadataValue.md((ws.eval_dir / "table.md").read_text()),
            "split_id": report["split_id"],
            "mlflow_run_id": report["mlflow_run_id"],
            **{f"{name}_predictions": metadata.image(ws.eval_dir / f"{name}_predictions.png", name) for name in TASK_NAMES},
        },
        data_version=dg.DataVersion(md5),
    )


@dg.asset_check(asset=evaluation_report, blocking=True)
def every_task_beats_baseline(platform: PlatformResource) -> dg.AssetCheckResult:
    """Quality gate before registration: each fine-tuned task beats its untrained-head baseline."""
    report = json.loads((platform.ws.eval_dir / "metrics.json").read_text())
    losing = [t["task"] for t in report["tasks"] if not t["beats_baseline"]]
    return dg.AssetCheckResult(passed=not losing, metadata={"not_beating_baseline": ", ".join(losing) or "none"})


@dg.asset(group_name="registry", deps=[evaluation_report, pretrained_backbone], retry_policy=TRANSIENT, kinds={"mlflow"})
def registered_models(context: dg.AssetExecutionContext, platform: PlatformResource) -> dg.MaterializeResult:
    """Each task model as an MLflow pyfunc version with lineage and evaluation tags."""
    ws, config = platform.ws, platform.config
    report = json.loads((ws.eval_dir / "metrics.json").read_text())
    model_md5 = {task: dvc_hash(ws.task_dir(task), ws) for task in TASK_NAMES}
    registrations = register_all(config, report, ws.root / "models", model_md5, Lineage.from_env(ws.curated_dir, ws.pretrain_dir))
    rows = pd.DataFrame([{"model": r.model_name, "version": r.version, "reused": r.reused} for r in registrations])
    return dg.MaterializeResult(metadata={"versions": metadata.table(rows), "split_id": report["split_id"]})


class PromoteConfig(dg.Config):
    reason: str = Field(default="end-to-end run", description="why this promotion was requested (recorded on the version)")


@dg.asset(group_name="registry", deps=[registered_models], retry_policy=TRANSIENT, kinds={"mlflow"})
def champion_models(context: dg.AssetExecutionContext, config: PromoteConfig, platform: PlatformResource) -> dg.MaterializeResult:
    """Moves each task's `champion` alias to the newest version only if it beats the champion on the same split."""
    ws, cfg = platform.ws, platform.config
    uri = tracking.tracking_uri_for(ws.root)
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    report = json.loads((ws.eval_dir / "metrics.json").read_text())
    rows = []
    for task in report["tasks"]:
        name = cfg.model_name(task["task"])
        latest = max(client.search_model_versions(f"name = '{name}'"), key=lambda mv: int(mv.version))
        decision = promote(name, latest.version, task["primary_metric"], task["higher_is_better"], report["split_id"],
                           reason_prefix=f"[{config.reason}; dagster run {context.run_id}] ", client=client)
        rows.append({"model": name, "version": latest.version, "promoted": decision.promoted, "reason": decision.reason})
        context.log.info(f"{name} v{latest.version}: {'promoted' if decision.promoted else 'refused'}: {decision.reason}")
    return dg.MaterializeResult(metadata={"decisions": metadata.table(pd.DataFrame(rows))})
