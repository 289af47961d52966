"""A training step rerun into the same output folder resumes only its own run: the same recipe
picks up where the checkpoint left it, another recipe is refused, naming what differs, and the
output folder is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL_RECIPE, make_curated

RECIPE = [f"{k}={v}" for k, v in SMALL_RECIPE.items() if k.startswith("finetune.") and "task_steps" not in k] + [
    "finetune.steps=4", "finetune.task_steps={}", "finetune.optim.warmup_steps=1", "finetune.log_every=1",
    "finetune.checkpoint.every_n_steps=2", f"pretrain.arch={SMALL_RECIPE['pretrain.arch']}",
]


def _finetune(root: Path, output: Path, settings: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "SAPIENS2_WORKSPACE": str(root), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pipelines.finetune", "--task", "normal", "--curated", str(root / "curated"),
               "--from-scratch", "--output", str(output), "--config", str(Path("params.yaml").resolve())]
    command += [a for s in settings for a in ("--set", s)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_rerun_resumes_its_own_checkpoint_and_refuses_another_recipes(tmp_path: Path) -> None:
    make_curated(tmp_path / "curated", n=12)
    output = tmp_path / "normal"
    first = _finetune(tmp_path, output, RECIPE)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    weights = (output / "model.safetensors").read_bytes()

    again = _finetune(tmp_path, output, RECIPE)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "[finetune normal] resumed from step 4/4" in again.stdout

    changed = _finetune(tmp_path, output, [*RECIPE, "finetune.optim.lr=0.01"])
    assert changed.returncode != 0
    assert "belongs to another run (recipe_sha: saved" in changed.stderr
    assert (output / "model.safetensors").read_bytes() == weights, "a refused resume must not touch the outputs"
