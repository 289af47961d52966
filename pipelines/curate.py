"""Curation step: score every file of a raw image pool, keep clean person photos, write a manifest.

``curate(input_dir, output_dir, config)`` reads every file under ``input_dir/images/`` (or
``input_dir`` itself when it has no ``images/``) and writes ``output_dir/manifest.parquet`` with
one row per input file, the kept images as ``output_dir/<path>`` (``images/<id><ext>``) and their
labels as ``output_dir/labels/<id>.npz`` when ``input_dir/labels/`` has them. ``source_path`` is
the file's path under the input image folder. ``output_dir/report.md`` (with plots and
thumbnails under ``output_dir/report/``) says what each stage dropped and why; the returned
summary's ``report_path`` points at it.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
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
import pandas as pd
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from sapiens2.curation.config import CurationConfig
from sapiens2.curation.decode import decode_image
from sapiens2.curation.dedup import Keypoints, orb_keypoints
from sapiens2.curation.filters import REASONS, SCORE_COLUMNS, FilterChain
from sapiens2.curation.passes import balance, deduplicate
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

    @property
    def images_per_second(self) -> float:
        return self.n_inputs / self.seconds if self.seconds > 0 else float("inf")


def list_inputs(input_dir: Path) -> list[Path]:
    """Every non-hidden file under the image root, sorted; ids (file stems) must be unique."""
    root = input_dir / "images" if (input_dir / "images").is_dir() else input_dir
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    seen: dict[str, Path] = {}
    for path in files:
        if path.stem in seen:
            raise ValueError(f"two input files share the id {path.stem!r}: {seen[path.stem]} and {path}")
        seen[path.stem] = path
    return files


def fetch_raw_pool(source: str, dest: str | Path) -> int:
    """Replace `dest` with the raw pool at `source` (`s3://bucket/prefix` or a local folder), its
    images under `dest/images/` (a source without an `images/` folder is all images); returns the
    number of input files. The copy is staged beside `dest` and moved into place when complete."""
    dest = Path(dest)
    staging = dest.with_name(f".{dest.name}.fetching")
    shutil.rmtree(staging, ignore_errors=True)
    if source.startswith("s3://"):
        from pipelines.s3 import download_prefix

        download_prefix(source, staging)
    elif Path(source).is_dir():
        shutil.copytree(source, staging)
    else:
        raise FileNotFoundError(f"raw_source {source!r}: neither an s3:// URI nor a folder")
    if not (staging / "images").is_dir():
        entries = list(staging.iterdir())
        (staging / "images").mkdir()
        for entry in entries:
            entry.rename(staging / "images" / entry.name)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return len(list_inputs(dest))


def assign_split(image_id: str, val_fraction: float) -> str:
    """train or val from a hash of the id alone, so a row's split never changes between runs."""
    digest = int.from_bytes(hashlib.sha256(image_id.encode()).digest()[:8], "big")
    return "val" if digest / 2**64 < val_fraction else "train"


_CHAIN: FilterChain | None = None


def _init_worker(config: CurationConfig) -> None:
    global _CHAIN
    cv2.setNumThreads(1)  # parallelism is across files; nested OpenCV threads only contend
    _CHAIN = FilterChain(config)


def _assess(paths: list[Path]) -> tuple[list[dict[str, Any]], Counter]:
    seconds: Counter = Counter()
    return _CHAIN.assess_batch(paths, seconds), seconds


@contextmanager
def _timed(seconds: Counter, name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    seconds[name] += time.perf_counter() - started


def _keypoints(path: Path) -> Keypoints:
    return orb_keypoints(decode_image(path, _CHAIN.config.max_pixels).image)


@contextmanager
def _workers(config: CurationConfig) -> Iterator[Pool | None]:
    """A process pool of ``config.workers`` filter chains, or None to run in this process."""
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
    """Order-preserving map over files with a progress bar."""
    bar = {"total": len(items), "desc": desc, "unit": "img", "leave": False}
    results = map(fn, items) if pool is None else pool.imap(fn, items, chunksize=1 if desc == "curate" else 8)
    return list(tqdm(results, **bar))


def _write_outputs(rows: list[dict[str, Any]], files: list[Path], input_dir: Path, output_dir: Path) -> Path:
    for sub in ("images", "labels"):
        shutil.rmtree(output_dir / sub, ignore_errors=True)
    (output_dir / "images").mkdir(parents=True)
    labels_in = input_dir / "labels"
    for row, path in zip(rows, files):
        if row["status"] != "kept":
            continue
        shutil.copyfile(path, output_dir / row["path"])
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


def curate(input_dir: str | Path, output_dir: str | Path,
           config: CurationConfig = CurationConfig()) -> CurationSummary:
    """Run every filter over the pool and write the curated dataset; see the module docstring."""
    start = time.perf_counter()
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    if output_dir == input_dir or input_dir.is_relative_to(output_dir / "images"):
        raise ValueError(f"output_dir {output_dir} would overwrite the inputs in {input_dir}")
    files = list_inputs(input_dir)
    root = input_dir / "images" if (input_dir / "images").is_dir() else input_dir
    seconds: Counter = Counter()
    with _workers(config) as pool:
        size = config.batch_size
        batches = [files[k:k + size] for k in range(0, len(files), size)]
        rows = []
        for batch_rows, batch_seconds in _map(pool, _assess, batches, "curate"):
            rows += batch_rows
            seconds += batch_seconds
        for row, path in zip(rows, files):
            image_id = path.stem
            row |= {"id": image_id, "path": f"images/{image_id}{path.suffix}",
                    "source_path": path.relative_to(root).as_posix(), "dup_group": None,
                    "cluster": None, "cluster_top": None,
                    "has_labels": (input_dir / "labels" / f"{image_id}.npz").is_file()}
        with _timed(seconds, "dedup"):
            deduplicate(rows, config, lambda idx: _map(pool, _keypoints, [files[i] for i in idx], "dedup"))
    with _timed(seconds, "balance"):
        cluster_sizes = balance(rows, config)
    for row in rows:
        row["split"] = assign_split(row["id"], config.val_fraction) if row["status"] == "kept" else None

    status_counts = Counter(row["status"] for row in rows)
    if sum(status_counts[s] for s in ("kept", "rejected", "quarantined")) != len(files):
        raise AssertionError(f"status counts {dict(status_counts)} do not add up to {len(files)} inputs")
    with _timed(seconds, "write"):
        manifest = _write_outputs(rows, files, input_dir, output_dir)
    reason_counts = Counter(row["reason"] for row in rows if row["reason"] is not None)
    with _timed(seconds, "report"):
        report = write_report(pd.read_parquet(manifest), root, output_dir, config, cluster_sizes)
    return CurationSummary(
        n_inputs=len(files),
        status_counts={s: status_counts[s] for s in ("kept", "rejected", "quarantined")},
        reason_counts={r: reason_counts[r] for r in REASONS},
        manifest_path=manifest,
        seconds=time.perf_counter() - start,
        report_path=report,
        cluster_sizes=cluster_sizes,
        stage_seconds={k: round(v, 4) for k, v in seconds.items()},
    )


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
    parser.add_argument("--config", type=Path, help="YAML file of CurationConfig fields")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        config = CurationConfig.from_yaml(args.config) if args.config else CurationConfig()
    except (OSError, ValueError) as err:
        parser.error(str(err))
    summary = curate(args.input, args.output, config)
    console = Console()
    console.print(summary_table(summary))
    console.print(f"{summary.images_per_second:.1f} images/s; manifest: {summary.manifest_path}; "
                  f"report: {summary.report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
