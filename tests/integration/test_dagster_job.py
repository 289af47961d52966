"""The Dagster code location: definitions load, the whole graph materialises in-process on a small
recipe, and a failing expectation blocks everything downstream of the curated dataset."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from mlflow import MlflowClient

from assets.curation import curated_dataset, curated_expectations, raw_pool, versioned_dataset
from assets.definitions import ALL_ASSETS, ALL_CHECKS, defs
from assets.resources import DvcResource, PlatformResource
from pipelines.common import dataset_stats, tracking
from pipelines.common.config import TASK_NAMES
from pipelines.common.version import DvcWorkspace

RESOURCES = {"platform": PlatformResource(), "dvc": DvcResource(), "pipes_subprocess_client": dg.PipesSubprocessClient()}


def test_definitions_load_with_grouped_assets_and_jobs() -> None:
    dg.Definitions.validate_loadable(defs)
    groups = {key.to_user_string(): spec.group_name for key, spec in
              ((s.key, s) for a in ALL_ASSETS for s in a.specs)}
    assert set(groups.values()) == {"curation", "pretraining", "finetuning", "controls", "evaluation", "registry"}
    assert sum(1 for g in groups.values() if g == "finetuning") == 5
    assert sorted(k for k, g in groups.items() if g == "controls") == sorted(f"scratch_{t}" for t in TASK_NAMES)
    assert defs.resolve_job_def("end_to_end") and defs.resolve_job_def("promote") and defs.resolve_job_def("rollback")


def test_invalid_run_config_fails_before_any_asset_runs(small_workspace: Path) -> None:
    resources = {**RESOURCES, "platform": PlatformResource(pretrain={"deepspeed": {"zero_stage": 4}})}
    result = dg.materialize([raw_pool], resources=resources, raise_on_error=False)
    assert not result.success
    assert not (small_workspace / "data" / "raw").exists()
    failure = next(e for e in result.all_events if e.is_failure)
    assert "zero_stage" in str(failure.event_specific_data)


def test_failing_expectation_blocks_downstream(small_workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = dataset_stats._STATS["pose"]
    monkeypatch.setitem(dataset_stats._STATS, "pose", lambda *a: {**real(*a), "num_keypoints": 16})
    result = dg.materialize(
        [raw_pool, curated_dataset, curated_expectations, versioned_dataset], resources=RESOURCES, raise_on_error=False,
    )
    checks = {e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data.passed
              for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks["labels_pose"] is False
    assert checks["curated_manifest"] is True
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert "curated_dataset" in materialized
    assert "versioned_dataset" not in materialized


@pytest.mark.slow
def test_end_to_end_job_materialises_everything(small_workspace: Path) -> None:
    result = dg.materialize([*ALL_ASSETS, *ALL_CHECKS], resources=RESOURCES, raise_on_error=False)
    failures = [str(e.event_specific_data) for e in result.all_events if e.is_failure]
    assert result.success, failures
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    # shard_scores is not in the job; curated_dataset records the shards it filtered as its partitions.
    assert materialized == {a.key.to_user_string() for a in ALL_ASSETS} | {"shard_scores"}
    checks = [e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert len(checks) == 8 and all(c.passed for c in checks)

    report = json.loads((small_workspace / "reports" / "eval" / "metrics.json").read_text())
    assert [t["task"] for t in report["tasks"]] == list(TASK_NAMES)
    assert all(t["beats_baseline"] for t in report["tasks"]), report

    uri = tracking.tracking_uri_for(small_workspace)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    for task in TASK_NAMES:
        champion = client.get_model_version_by_alias(f"sapiens2-{task}-production", "champion")
        assert champion.tags["promotion.source"].startswith(f"models:/sapiens2-{task}/")
        # The bytes training read, in DVC's format: the curated folder dvc.lock records.
        assert champion.tags["dvc.data_md5"] == DvcWorkspace(small_workspace).out_hash("data/curated")
        assert champion.tags["eval.split_id"] == report["split_id"]
        assert champion.tags["dagster_run_id"] == result.run_id  # the lineage names the run that made it
    status = DvcWorkspace(small_workspace).status()
    assert status == {"local": {}, "cloud": {}}
