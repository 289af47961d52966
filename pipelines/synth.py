"""Step: generate the synthetic web pool that stands in for a raw image pool."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from pipelines.config import PlatformConfig, load_config
from sapiens2.data.synth import generate_pool


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 synth", description=__doc__)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    labels = synthesize(args.output, load_config(args.config))
    print(labels["kind"].value_counts().to_string())
    return 0
