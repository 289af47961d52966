"""DeepSpeed ZeRO 1/2/3 in bf16 on CPU ranks (gloo) through sapiens2.train's Trainer: training, per-group
learning rates, full fp32 export, pruning, and kill-and-resume reproducing the uninterrupted run
bit for bit. The training itself runs in deepspeed_worker.py (see its docstring for the phases).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# About 70 s on 2 idle cores: four DeepSpeed start-ups dominate.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("deepspeed_worker.py")
STAGES = (1, 2, 3)
TOTAL_STEPS, CKPT_EVERY, FINAL_LR = 8, 4, 3e-4  # as in the worker: OPTIM.lr * min_lr_ratio


def _run(out: Path, phases: list[str], ranks: int | None) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks else []
    cmd = [sys.executable, *launcher, str(WORKER), "--phases", *phases, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Launch 1: uninterrupted runs, then crash runs (the last one SIGKILLed). Launch 2: resume.
    Returns the output folder and what the killed launch left behind, read before resuming."""
    out = tmp_path_factory.mktemp("deepspeed")
    killed = _run(out, ["full", "crash"], ranks=2)
    crash = out / "zero3" / "crash"
    left = {
        "returncode": killed.returncode,
        "log": killed.stdout + killed.stderr,
        "latest": (crash / "latest").read_text() if (crash / "latest").is_file() else None,
        "tags": sorted(p.name for p in crash.glob("step_*")),
    }
    resumed = _run(out, ["resume"], ranks=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return out, left


def test_crash_launch_died_by_sigkill_after_the_step_4_checkpoint(runs) -> None:
    out, left = runs
    assert left["returncode"] != 0 and "SIGKILL" in left["log"], left["log"][-3000:]
    assert all((out / f"zero{s}" / "full.pt").is_file() for s in STAGES)
    assert all((out / f"zero{s}" / "crash.pt").is_file() for s in STAGES[:-1])
    assert not (out / "zero3" / "crash.pt").exists()  # the killed run never reported
    assert left["latest"] == "step_00000004" and left["tags"] == ["step_00000004"]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_trains_in_bf16_with_per_group_lr(runs, stage: int) -> None:
    out, _ = runs
    report = _load(out / f"zero{stage}" / "full.pt")
    losses, init, final = report["losses"], report["init"], report["export"]
    assert len(losses) == TOTAL_STEPS and all(math.isfinite(x) for x in losses)
    assert losses[3] < 0.5 * losses[0]
    # Export at step 0 is the fp32 init exactly: the master weights were not rounded to bf16.
    # Frozen parameters have no master copy, so they come back as the bf16 values the forward used.
    assert report["frozen"] == ["frozen.weight", "frozen.bias"]
    bf16_init = {k: v.bfloat16().float() if k in report["frozen"] else v for k, v in init.items()}
    assert all(torch.equal(report["export_step0"][k], bf16_init[k]) for k in init)
    assert all(torch.equal(final[k], bf16_init[k]) for k in report["frozen"])
    assert list(final) == list(init)
    assert all(v.dtype == torch.float32 and v.shape == init[k].shape for k, v in final.items())
    assert report["fp32_params_full_on_all_ranks"] and report["fp32_params_equal_export"]
    # The lr_scale-0 group never moves; every other parameter does.
    for name, scale in report["lr_scales"].items():
        assert torch.equal(final[name], init[name]) == (scale == 0.0), name
    assert torch.equal(final["backbone.in_scale"], init["backbone.in_scale"])  # buffers stay fp32
    expected_lrs = sorted({FINAL_LR * s for s in report["lr_scales"].values()})
    assert sorted(set(report["group_lrs"])) == pytest.approx(expected_lrs)


def test_zero_stages_agree_on_the_loss_curve(runs) -> None:
    out, _ = runs
    curves = [_load(out / f"zero{s}" / "full.pt")["losses"] for s in STAGES]
    for curve in curves[1:]:
        assert curve == pytest.approx(curves[0], rel=2e-2)


def test_keep_last_prunes_older_checkpoints(runs) -> None:
    out, _ = runs
    full = out / "zero2" / "full"
    assert sorted(p.name for p in full.glob("step_*")) == ["step_00000008"]
    assert (full / "latest").read_text() == "step_00000008"


@pytest.mark.parametrize("stage", STAGES)
def test_resume_after_kill_reproduces_uninterrupted_run(runs, stage: int) -> None:
    out, _ = runs
    full = _load(out / f"zero{stage}" / "full.pt")
    resumed = _load(out / f"zero{stage}" / "resume.pt")
    assert resumed["resumed_step"] == CKPT_EVERY
    assert resumed["resumed_client_state"]["history"]["loss"] == full["losses"][:CKPT_EVERY]
    assert resumed["losses"] == full["losses"]
    assert list(resumed["export"]) == list(full["export"])
    for name, tensor in full["export"].items():
        assert torch.equal(resumed["export"][name], tensor), name


def test_single_process_without_torchrun(tmp_path: Path) -> None:
    done = _run(tmp_path, ["single"], ranks=None)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for stage in STAGES:
        report = _load(tmp_path / f"zero{stage}" / "single.pt")
        assert len(report["losses"]) == CKPT_EVERY and report["losses"][-1] < report["losses"][0]
        assert "world_size" in report["mismatch_error"]
        assert (tmp_path / f"zero{stage}" / "single" / "latest").read_text() == "step_00000004"
