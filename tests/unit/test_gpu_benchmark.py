"""benchmarks/gpu.py, the by-hand GPU throughput benchmark, smoke-run on CPU at a tiny size (about
30 s on 2 cores): the JSON is stdout's only content, each planned run reports positive throughput,
an arch outside --pretrain-archs only fine-tunes, and the FLOPs arithmetic follows the reference
table. The real measurement (sapiens2_0.4b / 1b at 1024x768 in bf16) needs the GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sapiens2.pretrain.config import ObjectiveConfig
from tests.conftest import SMALL_RECIPE

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu.py"
RUN_KEYS = {"arch", "phase", "image_size", "micro_batch", "warmup_steps", "steps_timed", "step_time_s",
            "images_per_s", "peak_memory_gib", "model_tflop_per_image", "achieved_tflops", "mfu"}
# 64x64, not 64x48: pretraining's half-side local crops must stay a multiple of the 16-px patch.
SMOKE_ARGS = ["--device", "cpu", "--archs", "sapiens2_debug,sapiens2_tiny", "--pretrain-archs", "sapiens2_debug",
              "--tasks", "seg", "--image-size", "64", "64", "--steps", "1", "--warmup", "0", "--micro-batch", "2",
              # The test recipe's small DINO heads and MAE decoder instead of 65,536 prototypes.
              *[arg for key, value in SMALL_RECIPE.items() if key.startswith("pretrain.objective.")
                for arg in ("--set", f"{key}={value}")]]


def _benchmark_module():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # --device cpu needs no GPU in sight
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMOKE_ARGS], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # the whole of stdout: DeepSpeed's own prints went to stderr


def test_an_arch_outside_pretrain_archs_only_fine_tunes(report: dict) -> None:
    assert [(r["arch"], r["phase"]) for r in report["runs"]] == [
        ("sapiens2_debug", "pretrain"), ("sapiens2_debug", "finetune:seg"), ("sapiens2_tiny", "finetune:seg")]


def test_every_run_reports_positive_throughput(report: dict) -> None:
    assert report["device"] == "cpu" and report["bf16"] is False and report["zero_stage"] == 2
    for run in report["runs"]:
        assert RUN_KEYS <= set(run) and "error" not in run, run
        assert run["images_per_s"] > 0 and run["step_time_s"] > 0 and len(run["step_times_s"]) == 1
        assert run["image_size"] == [64, 64] and run["micro_batch"] == 2
        assert run["peak_memory_gib"] is None and run["mfu"] is None  # no CUDA; debug sizes have no reference FLOPs
    assert [r["what"] for r in report["ratios"]] == [
        "sapiens2_debug: finetune:seg / pretrain", "finetune:seg: sapiens2_tiny / sapiens2_debug"]
    assert all(r["images_per_s_ratio"] > 0 for r in report["ratios"])


def test_flops_follow_the_reference_table() -> None:
    gpu = _benchmark_module()
    forward_0_4b = 2 * 1260e9  # GMACs x 2
    assert gpu.model_flops_per_image("sapiens2_0.4b", (1024, 768)) == pytest.approx(3 * forward_0_4b)
    assert gpu.model_flops_per_image("sapiens2_1b", (512, 768)) == pytest.approx(3 * 4715e9)  # half the pixels
    assert gpu.model_flops_per_image("sapiens2_debug", (64, 48)) is None
    # Student: 2 globals at 25 % of the tokens x3 + 2 locals at 1/4 of the tokens x3; teacher: 2 globals x1.
    objective = ObjectiveConfig(mask_ratio=0.75, n_local=2)
    assert gpu.model_flops_per_image("sapiens2_0.4b", (1024, 768), objective) == pytest.approx(5 * forward_0_4b)
    runs = [{"arch": "a", "phase": "pretrain", "images_per_s": 2.0, "model_tflop_per_image": 10.0},
            {"arch": "a", "phase": "finetune:seg", "images_per_s": 4.0, "model_tflop_per_image": 6.0},
            {"arch": "b", "phase": "finetune:seg", "images_per_s": 1.0, "model_tflop_per_image": 24.0},
            {"arch": "c", "phase": "finetune:seg", "error": "OutOfMemoryError"}]
    assert gpu.ratios(runs) == [
        {"what": "a: finetune:seg / pretrain", "images_per_s_ratio": 2.0, "if_equal_mfu": round(10 / 6, 4)},
        {"what": "finetune:seg: b / a", "images_per_s_ratio": 0.25, "if_equal_mfu": 0.25}]
