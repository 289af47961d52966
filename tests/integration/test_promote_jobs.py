"""The promotion asset and the rollback job as Dagster runs them, with the launchpad's `reason`,
against registered versions in the workspace's SQLite MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from mlflow import MlflowClient

from assets.definitions import defs
from assets.registry import champion_models
from assets.resources import PlatformResource
from pipelines.common import tracking
from pipelines.common.config import TASK_NAMES
from pipelines.common.eval_report import REPORT_TAG, report_sha256
from pipelines.common.model_registry import MODEL_SHA_TAG, SPLIT_TAG

TASK = "seg"


def _register(tmp_path: Path, client: MlflowClient, miou: float) -> None:
    """A registered version holding weights `sha-<miou>`."""
    name = f"sapiens2-{TASK}"
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name)
    source = tmp_path / f"model_{miou}"
    source.mkdir()
    client.create_model_version(name, str(source), tags={SPLIT_TAG: "split-1", "eval.mIoU": str(miou),
                                                          MODEL_SHA_TAG: f"sha-{miou}"})


def _report(ws: Path, miou: float) -> str:
    """The evaluation report that scored weights `sha-<miou>`; returns the id of the evaluation's
    MLflow run (tagged with the report's hash)."""
    (ws / "reports" / "eval").mkdir(parents=True, exist_ok=True)
    report = {"split_id": "split-1",
              "tasks": [{"task": TASK, "primary_metric": "mIoU", "higher_is_better": True, "model_sha256": f"sha-{miou}"}]}
    report_file = ws / "reports" / "eval" / "metrics.json"
    report_file.write_text(json.dumps(report))
    with tracking.start_stage_run("evaluation", "evaluation", {REPORT_TAG: report_sha256(report_file)},
                                  workspace_root=ws) as run:
        return run.info.run_id


def _materialize(reason: str) -> dg.ExecuteInProcessResult:
    return dg.materialize([champion_models], resources={"platform": PlatformResource()},
                          run_config={"ops": {"champion_models": {"config": {"reason": reason, "requested_by": "carol"}}}})


def test_promote_asset_then_rollback_job(small_workspace: Path, tmp_path: Path) -> None:
    uri = tracking.tracking_uri_for(small_workspace)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    prod = f"sapiens2-{TASK}-production"

    _register(tmp_path, client, 0.30)
    _register(tmp_path, client, 0.45)  # the newest version, not yet the one a report scored
    _report(small_workspace, 0.30)
    assert _materialize("first release").success
    # Promotion takes the version holding the weights the report scored, not the newest number.
    assert client.get_model_version_by_alias(prod, "champion").tags["promotion.source"] == f"models:/sapiens2-{TASK}/1"
    evaluation_run = _report(small_workspace, 0.45)
    run = _materialize("better seg model")
    assert run.success
    champion = client.get_model_version_by_alias(prod, "champion")
    assert str(champion.version) == "2" and str(client.get_model_version_by_alias(prod, "previous").version) == "1"
    assert champion.tags["promotion.reason"] == "better seg model" and champion.tags["promotion.by"] == "carol"
    assert champion.tags["promotion.evaluation_run"] == evaluation_run
    assert champion.tags["promotion.dagster_run_id"] == run.run_id
    table = run.asset_materializations_for_node("champion_models")[0].metadata["decisions"]
    assert "sapiens2-seg-production v2" in str(table.value)

    job = defs.resolve_job_def("rollback")
    config = {"ops": {"rollback_champions": {"config": {"reason": "canary failed", "tasks": [TASK]}}}}
    rolled = job.execute_in_process(run_config=config, resources={"platform": PlatformResource()})
    assert rolled.success
    restored = client.get_model_version_by_alias(prod, "champion")
    assert str(restored.version) == "1" and restored.tags["rollback.reason"] == "canary failed"
    assert restored.tags["rollback.dagster_run_id"] == rolled.run_id

    again = job.execute_in_process(run_config=config, resources={"platform": PlatformResource()}, raise_on_error=False)
    assert not again.success
    failure = next(e for e in again.all_events if e.is_failure)
    assert "no 'previous' version" in str(failure.event_specific_data)


def test_rollback_reason_is_required(small_workspace: Path) -> None:
    job = defs.resolve_job_def("rollback")
    with pytest.raises(dg.DagsterInvalidConfigError, match="reason"):
        job.execute_in_process(run_config={"ops": {"rollback_champions": {"config": {"tasks": list(TASK_NAMES)}}}},
                               resources={"platform": PlatformResource()})
