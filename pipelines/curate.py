"""Curation step: score every file of a raw image pool, keep clean person photos, write a manifest.

``curate(input_dir, output_dir, config)`` reads every file under ``input_dir/images/`` (or
``input_dir`` itself when it has no ``images/``) and writes ``output_dir/manifest.parquet`` with
one row per input file, the kept images as ``output_dir/<path>`` (``images/<id><ext>``) and their
labels as ``output_dir/labels/<id>.npz`` when ``input_dir/labels/`` has them. ``source_path`` is
the file's path under the input image folder. ``output_dir/report.md`` (with plots and
thumbnails under ``output_dir/report/``) says what each stage dropped and why; the returned
summary's ``report_path`` points at it.

It runs in three steps, each callable on its own (the Dagster assets do): ``shard_pool`` packs
the pool into tar shards (``<work>/shards``, ``sapiens2.curation.pool``); ``filter_shard``
(``pipelines.common.shard_scores``) runs the filter chain over one shard into
``<work>/scores/<shard>.parquet``, skipped when a valid one exists, so a killed run resumes at
the first unfinished shard; ``merge_shards`` runs the global dedup and balance passes over all
score files and writes the curated dataset. The work folder defaults to ``<output_dir>.work``
beside the output. The manifest depends only on the pool and the config, not on the shard size,
the worker count or how often the run was resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from pipelines.common.config import load_config
from pipelines.common.dataset_stats import write_label_manifests
from pipelines.common.lineage import Lineage, RankZeroTracker
from pipelines.common.plots import curation_scores_png
from pipelines.common.shard_scores import filter_pool, keypoints_in_workers, read_scores, workers
from sapiens2.curation.config import CurationConfig
from sapiens2.curation.dedup import Keypoints
from sapiens2.curation.filters import REASONS, SCORE_COLUMNS
from sapiens2.curation.passes import balance, deduplicate
from sapiens2.curation.pool import PoolShards, shard_pool
from sapiens2.curation.report import write_report

MANIFEST_COLUMNS = ("id", "path", "source_path", "status", "reason", "detail", *SCORE_COLUMNS,
                    "dup_group", "cluster", "cluster_top", "has_labels", "split")
_INT_COLUMNS = ("width", "height", "short_side", "num_persons", "cluster", "cluster_top")


@dataclass(frozen=True)
class CurationSummary:
    """What one curation run did: counts per status and per reason, and where the manifest is."""

    n_inputs: int
    status_counts: dict[str, int]
    reason_counts: dict[str, int]
    manifest_path: Path
    seconds: float = field(compare=False)
    report_path: Path | None = None
    cluster_sizes: dict[str, list[int]] | None = None
    # Seconds per step: per-image steps ("decode", each stage, "embed") summed over the workers'
    # batches, then the global "dedup", "balance", "write" and "report" passes.
    stage_seconds: dict[str, float] = field(default_factory=dict, compare=False)
    # Shards this run filtered (the others already had valid score files).
    filtered_shards: tuple[str, ...] = field(default=(), compare=False)

    @property
    def images_per_second(self) -> float:
        return self.n_inputs / self.seconds if self.seconds > 0 else float("inf")


def assign_split(image_id: str, val_fraction: float) -> str:
    """train or val from a hash of the id alone, so a row's split never changes between runs."""
    digest = int.from_bytes(hashlib.sha256(image_id.encode()).digest()[:8], "big")
    return "val" if digest / 2**64 < val_fraction else "train"


@contextmanager
def _timed(seconds: Counter, name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    seconds[name] += time.perf_counter() - started


def _write_outputs(rows: list[dict[str, Any]], pool: PoolShards, input_dir: Path, output_dir: Path) -> Path:
    for sub in ("images", "labels"):
        shutil.rmtree(output_dir / sub, ignore_errors=True)
    (output_dir / "images").mkdir(parents=True)
    labels_in = input_dir / "labels"
    kept = [row for row in rows if row["status"] == "kept"]
    for row, data in zip(kept, pool.read([row["source_path"] for row in kept])):
        (output_dir / row["path"]).write_bytes(data)
        if row["has_labels"]:
            (output_dir / "labels").mkdir(exist_ok=True)
            shutil.copyfile(labels_in / f"{row['id']}.npz", output_dir / "labels" / f"{row['id']}.npz")
    # Columns of stages beyond the default set follow the fixed ones; "_"-keys are in-memory only.
    extra = [c for c in dict.fromkeys(k for row in rows for k in row) if c not in MANIFEST_COLUMNS and c[0] != "_"]
    table = pd.DataFrame(rows, columns=[*MANIFEST_COLUMNS, *extra])
    for col in _INT_COLUMNS:
        table[col] = table[col].astype("Int64")
    manifest = output_dir / "manifest.parquet"
    table.to_parquet(manifest, index=False)
    return manifest


def merge_shards(pool: PoolShards, scores_dir: Path, input_dir: Path, output_dir: Path, config: CurationConfig,
                 workers_pool: Pool | None = None) -> CurationSummary:
    """The global passes over all shards' scores: dedup, balance, split; then write the curated
    dataset (kept images taken from the shards, labels from ``input_dir/labels``) and the report."""
    start = time.perf_counter()
    scores, seconds = read_scores(pool, scores_dir, config)
    embeddings = scores.pop("embedding") if "embedding" in scores else None
    rows = scores.astype(object).where(scores.notna(), None).to_dict("records")
    for k, row in enumerate(rows):
        ext = Path(row["source_path"]).suffix
        row |= {"path": f"images/{row['id']}{ext}", "dup_group": None, "cluster": None, "cluster_top": None,
                "has_labels": (input_dir / "labels" / f"{row['id']}.npz").is_file()}
        if embeddings is not None and embeddings[k] is not None:
            row["_embedding"] = np.asarray(embeddings[k], dtype=np.float32)

    def keypoints_of(indices: list[int]) -> list[Keypoints]:
        return keypoints_in_workers(workers_pool, config, pool.read([rows[i]["source_path"] for i in indices]))

    with _timed(seconds, "dedup"):
        deduplicate(rows, config, keypoints_of)
    with _timed(seconds, "balance"):
        cluster_sizes = balance(rows, config)
    for row in rows:
        row["split"] = assign_split(row["id"], config.val_fraction) if row["status"] == "kept" else None

    status_counts = Counter(row["status"] for row in rows)
    if sum(status_counts[s] for s in ("kept", "rejected", "quarantined")) != len(pool.index):
        raise AssertionError(f"status counts {dict(status_counts)} do not add up to {len(pool.index)} inputs")
    with _timed(seconds, "write"):
        manifest = _write_outputs(rows, pool, input_dir, output_dir)
    reason_counts = Counter(row["reason"] for row in rows if row["reason"] is not None)
    with _timed(seconds, "report"):
        report = write_report(pd.read_parquet(manifest), pool.read, output_dir, config, cluster_sizes)
    return CurationSummary(
        n_inputs=len(pool.index),
        status_counts={s: status_counts[s] for s in ("kept", "rejected", "quarantined")},
        reason_counts={r: reason_counts[r] for r in REASONS},
        manifest_path=manifest,
        seconds=time.perf_counter() - start,
        report_path=report,
        cluster_sizes=cluster_sizes,
        stage_seconds={k: round(v, 4) for k, v in seconds.items()},
    )


def default_work_dir(output_dir: Path) -> Path:
    return output_dir.with_name(f"{output_dir.name}.work")


def _check_output(input_dir: Path, output_dir: Path) -> None:
    if output_dir == input_dir or input_dir.is_relative_to(output_dir / "images"):
        raise ValueError(f"output_dir {output_dir} would overwrite the inputs in {input_dir}")


def curate(input_dir: str | Path, output_dir: str | Path, config: CurationConfig = CurationConfig(),
           work_dir: str | Path | None = None) -> CurationSummary:
    """Shard the pool, filter every shard not yet filtered, then merge; see the module docstring."""
    start = time.perf_counter()
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    _check_output(input_dir, output_dir)
    work_dir = Path(work_dir) if work_dir is not None else default_work_dir(output_dir)
    pool = shard_pool(input_dir, work_dir / "shards", config.shard_size)
    sharding = time.perf_counter() - start
    with workers(config) as workers_pool:
        filtered = filter_pool(pool, work_dir / "scores", config, workers_pool)
        summary = merge_shards(pool, work_dir / "scores", input_dir, output_dir, config, workers_pool)
    return dataclasses.replace(summary, seconds=time.perf_counter() - start, filtered_shards=tuple(filtered),
                               stage_seconds={"shard": round(sharding, 4), **summary.stage_seconds})


@dataclass(frozen=True)
class CurationRun:
    summary: CurationSummary
    scores_plot: Path
    mlflow_run_id: str | None


def curate_step(input_dir: str | Path, output_dir: str | Path, config: CurationConfig,
                work_dir: str | Path | None = None, dagster_run_id: str | None = None) -> CurationRun:
    """The `curate` step as the CLI, `dvc repro` and Dagster run it: a fresh `output_dir` with
    everything `curate` writes plus the per-task label statistics (`labels/<task>.parquet`) and
    `curation_scores.png`, recorded as an MLflow run of `sapiens2/curation`. Nothing else writes
    into the folder, so its DVC md5 does not depend on who ran the step."""
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    _check_output(input_dir, output_dir)
    if input_dir.is_relative_to(output_dir):  # the output folder is replaced whole
        raise ValueError(f"output_dir {output_dir} holds the inputs in {input_dir}: curating would delete them")
    shutil.rmtree(output_dir, ignore_errors=True)
    summary = curate(input_dir, output_dir, config, work_dir)
    write_label_manifests(output_dir)
    manifest = pd.read_parquet(summary.manifest_path)
    plot = curation_scores_png(manifest, output_dir / "curation_scores.png")
    lineage = Lineage.from_env(input_dir, dagster_run_id=dagster_run_id)
    with RankZeroTracker(0, "curation", lineage, config.model_dump(mode="json")) as tracker:
        tracker.log_metrics({f"images_{k}": float(v) for k, v in summary.status_counts.items()}, 0)
        tracker.log_artifacts([plot, summary.manifest_path, summary.report_path])
        tracker.log_artifacts(sorted((output_dir / "report").glob("*.png")), artifact_path="report")
    return CurationRun(summary, plot, tracker.run_id)


def summary_table(summary: CurationSummary) -> Table:
    table = Table(title="curation")
    table.add_column("status / reason")
    table.add_column("images", justify="right")
    table.add_row("[bold]inputs", str(summary.n_inputs), end_section=True)
    for status, count in summary.status_counts.items():
        table.add_row(f"[bold]{status}", str(count))
    for reason, count in summary.reason_counts.items():
        table.add_row(f"  {reason}", str(count))
    return table


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 curate", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, type=Path, help="raw pool (with images/ and optional labels/)")
    parser.add_argument("--output", required=True, type=Path, help="curated dataset directory")
    parser.add_argument("--config", type=Path,
                        help="platform params file (params.yaml): its curation section (default: built-in defaults)")
    parser.add_argument("--work", type=Path, help="shards and per-shard scores (default: <output>.work)")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        config = load_config(args.config).curation if args.config else CurationConfig()
    except (OSError, ValueError) as err:
        parser.error(str(err))
    summary = curate_step(args.input, args.output, config, args.work).summary
    console = Console()
    console.print(summary_table(summary))
    console.print(f"{summary.images_per_second:.1f} images/s; manifest: {summary.manifest_path}; "
                  f"report: {summary.report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
