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

TASK = "seg"


def _report(ws: Path, tmp_path: Path, client: MlflowClient, miou: float) -> None:
    name = f"sapiens2-{TASK}"
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name)
    source = tmp_path / f"model_{miou}"
    source.mkdir()
    client.create_model_version(name, str(source), tags={"eval.split_id": "split-1", "eval.mIoU": str(miou)})
    (ws / "reports" / "eval").mkdir(parents=True, exist_ok=True)
    report = {"split_id": "split-1", "mlflow_run_id": f"eval-{miou}",
              "tasks": [{"task": TASK, "primary_metric": "mIoU", "higher_is_better": True}]}
    (ws / "reports" / "eval" / "metrics.json").write_text(json.dumps(report))


def _materialize(reason: str) -> dg.ExecuteInProcessResult:
    return dg.materialize([champion_models], resources={"platform": PlatformResource()},
                          run_config={"ops": {"champion_models": {"config": {"reason": reason, "requested_by": "carol"}}}})


def test_promote_asset_then_rollback_job(small_workspace: Path, tmp_path: Path) -> None:
    uri = tracking.tracking_uri_for(small_workspace)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    prod = f"sapiens2-{TASK}-production"

    _report(small_workspace, tmp_path, client, 0.30)
    assert _materialize("first release").success
    _report(small_workspace, tmp_path, client, 0.45)
    run = _materialize("better seg model")
    assert run.success
    champion = client.get_model_version_by_alias(prod, "champion")
    assert str(champion.version) == "2" and str(client.get_model_version_by_alias(prod, "previous").version) == "1"
    assert champion.tags["promotion.reason"] == "better seg model" and champion.tags["promotion.by"] == "carol"
    assert champion.tags["promotion.evaluation_run"] == "eval-0.45"
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
