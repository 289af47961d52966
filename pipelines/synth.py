"""Step: the raw image pool, fetched from `raw_source` (S3 prefix or folder) when the config
names one, else the synthetic web pool that stands in for it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from pipelines.common.config import PlatformConfig, load_config
from sapiens2.curation.pool import list_inputs, regular_files
from sapiens2.data.synth import generate_pool


def fetch_raw_pool(source: str, dest: str | Path) -> int:
    """Replace `dest` with the raw pool at `source` (`s3://bucket/prefix` or a local folder), its
    images under `dest/images/` (a source without an `images/` folder is all images); returns the
    number of input files. The copy is staged beside `dest` and moved into place when complete."""
    dest = Path(dest)
    staging = dest.with_name(f".{dest.name}.fetching")
    shutil.rmtree(staging, ignore_errors=True)
    if source.startswith("s3://"):
        from pipelines.common.s3 import download_prefix

        download_prefix(source, staging)
    elif Path(source).is_dir():
        regular_files(Path(source))  # refuses links before copying: copytree would follow them
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


def synthesize(output_dir: Path, config: PlatformConfig) -> pd.DataFrame:
    """Render `config.synth.n_people` people plus distractors into `output_dir`; returns the pool labels."""
    height, width = config.image_size
    return generate_pool(
        output_dir,
        n_people=config.synth.n_people,
        seed=config.synth.seed,
        height=height,
        width=width,
        workers=config.synth.workers,
        keypoint_set=config.keypoint_set,
    )


def build_raw_pool(output_dir: Path, config: PlatformConfig) -> dict[str, int]:
    """Replace `output_dir` with the raw pool; returns its image count per kind. A fetched pool
    replaces the old one only once complete."""
    if config.raw_source:
        return {"fetched": fetch_raw_pool(config.raw_source, output_dir)}
    shutil.rmtree(output_dir, ignore_errors=True)
    return {str(k): int(v) for k, v in synthesize(output_dir, config)["kind"].value_counts().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 synth", description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    counts = build_raw_pool(args.output, load_config(args.config))
    print("\n".join(f"{kind:12s} {count}" for kind, count in counts.items()))
    return 0
