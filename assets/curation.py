"""Curation group: raw pool -> curated dataset -> great-expectations gate -> DVC-versioned dataset."""

import dagster as dg
import pandas as pd

from assets import metadata
from assets.resources import DvcResource, PlatformResource
from pipelines.common.shard_scores import config_fingerprint, filter_shard, score_path, shard_is_filtered, workers
from pipelines.curate import curate_step
from pipelines.synth import build_raw_pool
from sapiens2.curation.pool import INDEX, PoolShards, list_inputs, open_pool, shard_pool

SUITES = ("curated_manifest", "curated_counts", "labels_pose", "labels_seg", "labels_normal", "labels_pointmap", "labels_albedo")
TRANSIENT = dg.RetryPolicy(max_retries=2, delay=5, backoff=dg.Backoff.EXPONENTIAL)


@dg.asset(group_name="curation", retry_policy=TRANSIENT, kinds={"python", "dvc"})
def raw_pool(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource) -> dg.MaterializeResult:
    """The raw image pool: fetched from `raw_source` (an S3 prefix or a folder) when configured,
    else synthetic people with labels for all five tasks plus web-pool distractors."""
    ws, source = platform.ws, platform.config.raw_source
    counts = build_raw_pool(ws.raw_dir, platform.config)
    md5 = dvc.commit(ws, "synth", ws.raw_dir)
    kinds = pd.DataFrame({"kind": list(counts), "images": list(counts.values())})
    return dg.MaterializeResult(
        metadata={"images": sum(counts.values()), "kinds": metadata.table(kinds), "dvc_md5": md5,
                  "source": source or "synthetic"},
        data_version=dg.DataVersion(md5),
    )


POOL_SHARDS = dg.DynamicPartitionsDefinition(name="pool_shards")


def _shard_table(pool: PoolShards) -> pd.DataFrame:
    return pool.index.groupby("shard", sort=False).agg(images=("id", "size"), bytes=("size", "sum")).reset_index()


@dg.asset(group_name="curation", deps=[raw_pool], kinds={"python", "parquet"})
def pool_shards(context: dg.AssetExecutionContext, platform: PlatformResource) -> dg.MaterializeResult:
    """The raw pool packed into tar shards with a Parquet index (append-only: new files go into
    new shards); each shard is registered as a partition of `shard_scores` (the discovery step)."""
    ws = platform.ws
    pool = shard_pool(ws.raw_dir, ws.curation_work_dir / "shards", platform.config.curation.shard_size)
    new = register_new_shards(context.instance, pool)
    context.log.info(f"{len(pool.names)} shards, {len(new)} new: {new[:5]}{' ...' if len(new) > 5 else ''}")
    return dg.MaterializeResult(metadata={
        "shards": len(pool.names), "images": len(pool.index), "new_partitions": len(new),
        "per_shard": metadata.table(_shard_table(pool)), "index": dg.MetadataValue.path(str(pool.root / INDEX)),
    })


def register_new_shards(instance: dg.DagsterInstance, pool: PoolShards) -> list[str]:
    known = set(instance.get_dynamic_partitions(POOL_SHARDS.name))
    new = [name for name in pool.names if name not in known]
    if new:
        instance.add_dynamic_partitions(POOL_SHARDS.name, new)
    return new


def _shard_metadata(path) -> dict:
    scores = pd.read_parquet(path, columns=["status", "reason"])
    return {"images": len(scores), **{k: int(v) for k, v in scores["status"].value_counts().items()},
            "reasons": dg.MetadataValue.json({k: int(v) for k, v in scores["reason"].value_counts().items()})}


@dg.asset(group_name="curation", deps=[pool_shards], partitions_def=POOL_SHARDS, kinds={"python", "parquet"})
def shard_scores(context: dg.AssetExecutionContext, platform: PlatformResource) -> dg.MaterializeResult:
    """One shard through the filter chain: every file's scores and verdict (kept, rejected,
    quarantined), before the global dedup and balance. A valid score file is reused."""
    ws, config = platform.ws, platform.config.curation
    pool, shard = open_pool(ws.curation_work_dir / "shards"), context.partition_key
    scores = ws.curation_work_dir / "scores"
    reused = shard_is_filtered(pool, shard, scores, config)
    if not reused:
        with workers(config) as pool_of_workers:
            filter_shard(pool, shard, scores, config, pool_of_workers)
    path = score_path(scores, shard)
    return dg.MaterializeResult(metadata={**_shard_metadata(path), "reused": reused,
                                          "path": dg.MetadataValue.path(str(path))})


# shard_scores is not a declared dependency: curated_dataset filters the shards its partitions
# have not, so a pool never filtered by partition runs is no "missing upstream" (the UI would ask
# to confirm every "Materialize all"); it records the shards it filtered as those partitions.
@dg.asset(group_name="curation", deps=[raw_pool, pool_shards], kinds={"python", "mlflow"})
def curated_dataset(context: dg.AssetExecutionContext, platform: PlatformResource) -> dg.MaterializeResult:
    """Filter the shards `shard_scores` has not (size, quality, text, person), then dedup,
    balance and split over all of them; a killed run resumes at the first unfinished shard."""
    ws, config = platform.ws, platform.config
    run = curate_step(ws.raw_dir, ws.curated_dir, config.curation, ws.curation_work_dir, context.run.run_id)
    pool, summary, scores = open_pool(ws.curation_work_dir / "shards"), run.summary, ws.curation_work_dir / "scores"
    register_new_shards(context.instance, pool)
    for shard in summary.filtered_shards:  # the partitions filtered here count as materialised, as if run on their own
        context.log_event(dg.AssetMaterialization(asset_key=shard_scores.key, partition=shard,
                                                  metadata={**_shard_metadata(score_path(scores, shard)),
                                                            "filtered_by": "curated_dataset"}))
    manifest = pd.read_parquet(summary.manifest_path)
    counts = manifest.fillna({"reason": "-"}).groupby(["status", "reason"]).size().reset_index(name="images")
    status = manifest["status"].value_counts().to_dict()
    return dg.MaterializeResult(metadata={
        "inputs": len(manifest),
        **{k: int(v) for k, v in status.items()},
        "train": int((manifest["split"] == "train").sum()),
        "val": int((manifest["split"] == "val").sum()),
        "status_and_reason": metadata.table(counts),
        "scores": metadata.image(run.scores_plot, "curation scores"),
        "report": dg.MetadataValue.md(summary.report_path.read_text()),
        "report_path": dg.MetadataValue.path(str(summary.report_path)),
        "stage_seconds": dg.MetadataValue.json(summary.stage_seconds),
        "shards": len(pool.names),
        "shards_filtered_here": len(summary.filtered_shards),
        "mlflow_run_id": run.mlflow_run_id or "",
    })


@dg.multi_asset_check(
    specs=[dg.AssetCheckSpec(name, asset=curated_dataset, blocking=True) for name in SUITES],
    can_subset=False,
)
def curated_expectations(context: dg.AssetCheckExecutionContext, platform: PlatformResource):
    """great-expectations suites over the curated manifest and each task's label manifest.

    Blocking: a failed suite stops every downstream asset; its metadata names the expectations."""
    ws = platform.ws
    inputs = len(list_inputs(ws.raw_dir))  # what curation read: nested folders in, hidden files out
    num_keypoints = platform.config.task("pose").num_keypoints
    from pipelines.validate import validate_curated  # great-expectations: ~4 s to import, loaded when the check runs

    for result in validate_curated(ws.curated_dir, input_count=inputs, num_keypoints=num_keypoints):
        failed = pd.DataFrame([
            {"expectation": f.expectation_type, "column": f.column or "", "observed": f.observed, "ids": ", ".join(f.ids[:5])}
            for f in result.failed
        ])
        yield dg.AssetCheckResult(
            check_name=result.suite, asset_key=curated_dataset.key, passed=result.success,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={"expectations": result.evaluated, "failed": len(result.failed),
                      **({"failures": metadata.table(failed)} if len(failed) else {})},
        )


@dg.asset(group_name="curation", deps=[curated_dataset], retry_policy=TRANSIENT, kinds={"dvc"})
def versioned_dataset(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource) -> dg.MaterializeResult:
    """The validated curated dataset recorded in dvc.lock and pushed to the DVC remote.

    Its DVC md5 is the data version every training run and model version is tagged with."""
    ws = platform.ws
    md5 = dvc.commit(ws, "curate", ws.curated_dir)
    return dg.MaterializeResult(
        metadata={"dvc_md5": md5, "path": str(ws.curated_dir), "remote": dvc.remote_url or ws.dvc_remote},
        data_version=dg.DataVersion(md5),
    )


filter_shards_job = dg.define_asset_job(
    "filter_shards", selection=[shard_scores], partitions_def=POOL_SHARDS,
    description="Filter one pool shard (a partition of shard_scores); the new_shards sensor launches one run per shard.",
)


@dg.sensor(job=filter_shards_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED)
def new_shards(context: dg.SensorEvaluationContext, platform: PlatformResource) -> dg.SensorResult | dg.SkipReason:
    """Registers the shards in the pool index as partitions and requests a run for each shard
    without a valid score file; a shard is requested once per content and config (the run key).

    Off by default: turn it on where shards arrive from elsewhere (another job, a data drop
    packed with `shard_pool`) or to fan a pool out over a Kubernetes cluster, one pod per shard."""
    ws, config = platform.ws, platform.config.curation
    shards = ws.curation_work_dir / "shards"
    if not (shards / INDEX).is_file():
        return dg.SkipReason(f"no pool index at {shards / INDEX} yet")
    pool = open_pool(shards)
    known = set(context.instance.get_dynamic_partitions(POOL_SHARDS.name))
    new = [name for name in pool.names if name not in known]
    fingerprint = config_fingerprint(config)[:16]
    todo = [name for name in pool.names if not shard_is_filtered(pool, name, ws.curation_work_dir / "scores", config)]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"{name}:{pool.digest(name)[:16]}:{fingerprint}", partition_key=name)
                      for name in todo],
        dynamic_partitions_requests=[POOL_SHARDS.build_add_request(new)] if new else [],
    )
