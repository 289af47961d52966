"""Curation group: raw pool -> curated dataset -> great-expectations gate -> DVC-versioned dataset."""


import shutil

import dagster as dg
import pandas as pd

from assets import metadata
from assets.resources import DvcResource, PlatformResource
from pipelines.curate import curate
from pipelines.dataset_stats import build_label_manifests
from pipelines.lineage import Lineage, RankZeroTracker
from pipelines.plots import curation_scores_png
from pipelines.synth import build_raw_pool
from pipelines.validate import validate_curated

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


@dg.asset(group_name="curation", deps=[raw_pool], kinds={"python", "mlflow"})
def curated_dataset(context: dg.AssetExecutionContext, platform: PlatformResource) -> dg.MaterializeResult:
    """Decode, quarantine, filter (size, person, quality, text), dedup and split the raw pool."""
    ws, config = platform.ws, platform.config
    shutil.rmtree(ws.curated_dir, ignore_errors=True)
    summary = curate(ws.raw_dir, ws.curated_dir, config.curation)
    build_label_manifests(ws.curated_dir)
    manifest = pd.read_parquet(ws.curated_dir / "manifest.parquet")
    counts = manifest.fillna({"reason": "-"}).groupby(["status", "reason"]).size().reset_index(name="images")
    plot = curation_scores_png(manifest, ws.curated_dir / "curation_scores.png")
    status = manifest["status"].value_counts().to_dict()
    with RankZeroTracker(0, "curation", Lineage.from_env(ws.raw_dir, dagster_run_id=context.run.run_id), config.curation.model_dump(mode="json")) as tracker:
        tracker.log_metrics({f"images_{k}": float(v) for k, v in status.items()}, 0)
        tracker.log_artifacts([plot, ws.curated_dir / "manifest.parquet", summary.report_path])
        tracker.log_artifacts(sorted((summary.report_path.parent / "report").glob("*.png")), artifact_path="report")
    return dg.MaterializeResult(metadata={
        "inputs": len(manifest),
        **{k: int(v) for k, v in status.items()},
        "train": int((manifest["split"] == "train").sum()),
        "val": int((manifest["split"] == "val").sum()),
        "status_and_reason": metadata.table(counts),
        "scores": metadata.image(plot, "curation scores"),
        "report": dg.MetadataValue.md(summary.report_path.read_text()),
        "report_path": dg.MetadataValue.path(str(summary.report_path)),
        "stage_seconds": dg.MetadataValue.json(summary.stage_seconds),
        "mlflow_run_id": tracker.run_id or "",
    })


@dg.multi_asset_check(
    specs=[dg.AssetCheckSpec(name, asset=curated_dataset, blocking=True) for name in SUITES],
    can_subset=False,
)
def curated_expectations(context: dg.AssetCheckExecutionContext, platform: PlatformResource):
    """great-expectations suites over the curated manifest and each task's label manifest.

    Blocking: a failed suite stops every downstream asset; its metadata names the expectations."""
    ws = platform.ws
    inputs = sum(1 for p in (ws.raw_dir / "images").iterdir() if p.is_file())
    num_keypoints = platform.config.task("pose").num_keypoints
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
