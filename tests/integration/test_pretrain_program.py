"""The pretraining program end to end: 2 DeepSpeed ranks (ZeRO-3, gloo on CPU), checkpoints, and a
run killed after a checkpoint that resumes to the same weights as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from sapiens2.data.synth import render_person
from tests.conftest import SMALL_RECIPE

STEPS = 8
SETTINGS = [f"{k}={v}" for k, v in SMALL_RECIPE.items() if k.startswith("pretrain.")] + [
    f"pretrain.steps={STEPS}", "pretrain.checkpoint.every_n_steps=2", "pretrain.deepspeed.zero_stage=3",
]


def _curated(root: Path, n: int = 16) -> Path:
    """A curated folder (manifest + images) of rendered people, enough for pretraining."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(n):
        Image.fromarray(render_person(np.random.default_rng(i)).image).save(root / "images" / f"{i:04d}.png")
        rows.append({"id": f"{i:04d}", "path": f"images/{i:04d}.png", "status": "kept", "reason": None, "split": "train"})
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet")
    return root


def _command(curated: Path, output: Path) -> list[str]:
    args = ["--curated", str(curated), "--output", str(output), "--config", str(Path("params.yaml").resolve())]
    return [sys.executable, "-m", "pipelines.pretrain", *args, *(a for s in SETTINGS for a in ("--set", s))]


def _run(curated: Path, output: Path, env: dict) -> None:
    proc = subprocess.run(_command(curated, output), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    curated = _curated(tmp_path / "curated")
    env = {**os.environ, "SAPIENS2_WORKSPACE": str(tmp_path)}

    _run(curated, tmp_path / "whole", env)
    whole = load_file(tmp_path / "whole" / "backbone.safetensors")

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen(_command(curated, interrupted), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    latest = interrupted / "checkpoints" / "latest"
    deadline = time.time() + 500
    while not latest.is_file() and time.time() < deadline:
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "backbone.safetensors").exists()

    _run(curated, interrupted, env)
    resumed = load_file(interrupted / "backbone.safetensors")
    assert whole.keys() == resumed.keys()
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed[name]), name
    assert (interrupted / "mae_reconstruction.png").stat().st_size > 0
