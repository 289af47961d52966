"""benchmarks/recipe_calibration.py, the plain-loop recipe calibration, smoke-run on the tests'
small curated set: stdout is one JSON object whose score is the evaluation's metric on `val`, the
overrides reach the recipe, and a learning curve has a point per `--eval-every`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_curated

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "recipe_calibration.py"


@pytest.mark.parametrize("task", ["seg", "pose"])
def test_calibration_prints_one_json_object_with_the_val_score(tmp_path: Path, task: str) -> None:
    curated = make_curated(tmp_path / "curated")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--curated", str(curated), "--task", task, "--steps", "4", "--eval-every", "2",
         "--set", "pretrain.arch=sapiens2_debug", "--set", "finetune.deepspeed.micro_batch_size=2",
         "--set", "finetune.optim.warmup_steps=1", "--set", "finetune.optim.head_lr_scale=3"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["task"] == task and result["steps"] == 4 and result["batch"] == 2
    assert result["primary_metric"] == {"seg": "mIoU", "pose": "AP"}[task]
    assert result["value"] == result["metrics"][result["primary_metric"]]
    assert [step for step, _ in result["curve"]] == [2, 4]
    assert "finetune.optim.head_lr_scale=3" in result["overrides"]
