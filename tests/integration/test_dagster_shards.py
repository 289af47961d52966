"""Pool shards in Dagster: the discovery asset registers partitions, a partition run filters one
shard, the sensor requests the rest (once per content), and curated_dataset reuses what the
partition runs left, filters the remaining shards itself and records them as partitions."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest

from assets.curation import POOL_SHARDS, curated_dataset, new_shards, pool_shards, shard_scores
from assets.resources import DvcResource, PlatformResource
from sapiens2.data.synth import generate_pool
from tests.conftest import SMALL_RECIPE, make_workspace

RESOURCES = {"platform": PlatformResource(), "dvc": DvcResource()}


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = make_workspace(tmp_path / "ws", {**SMALL_RECIPE, "curation.shard_size": 20, "curation.workers": 1})
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(root))
    monkeypatch.setenv("SAPIENS2_DVC_REMOTE", str(tmp_path / "dvc-remote"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    generate_pool(root / "data" / "raw", n_people=40, seed=5, workers=2, progress=False)
    return root


def _sensor_requests(instance: dg.DagsterInstance) -> dg.SensorResult:
    with dg.build_sensor_context(instance=instance, resources=RESOURCES) as context:
        return new_shards(context)


def _materialized_partitions(instance: dg.DagsterInstance) -> set[str]:
    return instance.get_materialized_partitions(shard_scores.key)


def test_shards_become_partitions_and_curation_reuses_their_scores(workspace: Path) -> None:
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([pool_shards], instance=instance, resources=RESOURCES).success
    names = instance.get_dynamic_partitions(POOL_SHARDS.name)
    assert names == [f"pool-{k:05d}" for k in range(len(names))] and len(names) >= 3

    first = dg.materialize([shard_scores], partition_key=names[0], instance=instance, resources=RESOURCES)
    meta = first.asset_materializations_for_node("shard_scores")[0].metadata
    assert meta["reused"].value is False and meta["images"].value == 20
    assert _materialized_partitions(instance) == {names[0]}

    # The sensor asks for every shard without a score file, once per content and config.
    result = _sensor_requests(instance)
    assert [r.partition_key for r in result.run_requests] == names[1:]
    assert len({r.run_key for r in result.run_requests}) == len(names) - 1

    # New files: the discovery asset appends a shard; the sensor registers nothing twice.
    raw = workspace / "data" / "raw" / "images"
    for k, path in enumerate(sorted(raw.iterdir())[:3]):
        shutil.copyfile(path, raw / f"zz_copy_{k}{path.suffix}")
    assert dg.materialize([pool_shards], instance=instance, resources=RESOURCES).success
    grown = instance.get_dynamic_partitions(POOL_SHARDS.name)
    assert grown == [*names, f"pool-{len(names):05d}"]
    assert _sensor_requests(instance).dynamic_partitions_requests == []

    run = dg.materialize([curated_dataset], instance=instance, resources=RESOURCES)
    meta = next(m for m in run.asset_materializations_for_node("curated_dataset")
                if m.asset_key == curated_dataset.key).metadata
    assert meta["shards"].value == len(grown)
    assert meta["shards_filtered_here"].value == len(grown) - 1  # the first shard's scores were reused
    assert meta["inputs"].value == sum(1 for _ in raw.iterdir())
    assert _materialized_partitions(instance) == set(grown)
    assert _sensor_requests(instance).run_requests == []  # nothing left to filter
