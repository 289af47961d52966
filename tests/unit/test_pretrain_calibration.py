"""benchmarks/pretrain_calibration.py, the plain-loop pretraining calibration, smoke-run on the
tests' small curated set: stdout is one JSON object with the random backbone's probe floors, a
probe point per `--probe-every` for the student and the teacher, the final losses and monitors,
and `--export` writes both backbones in the layout fine-tuning loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sapiens2.model import build_backbone, load_checkpoint
from tests.conftest import make_curated

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrain_calibration.py"


def test_pretrain_calibration_prints_probe_curves_and_exports_both_backbones(tmp_path: Path) -> None:
    curated = make_curated(tmp_path / "curated")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--curated", str(curated), "--steps", "4", "--probe-every", "2",
         "--batch", "2", "--export", str(tmp_path / "export"), "--threads", "1",
         "--set", "pretrain.arch=sapiens2_debug", "--set", "pretrain.optim.warmup_steps=1",
         "--set", "pretrain.objective.dino_out_dim=16"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["steps"] == 4 and result["batch"] == 2
    assert [point["step"] for point in result["curve"]] == [2, 4]
    for point in result["curve"]:
        for weights in ("student", "teacher"):
            assert 0.0 <= point[weights]["part_correspondence_acc"] <= 1.0
    assert result["random"]["part_correspondence_chance"] > 0
    assert {"loss_mae", "loss_cl", "teacher_entropy", "agreement"} <= set(result["final"])
    for weights in ("student", "teacher"):
        backbone = build_backbone("sapiens2_debug", img_size=(128, 96))
        load_checkpoint(backbone, tmp_path / "export" / f"{weights}.safetensors")
