"""`dvc repro` runs the stages as `dvc.yaml` writes them, and a stage's output has the same DVC
md5 whichever way it ran: the CLI verb under DVC or the Dagster asset (the steps own their
outputs, the assets only call them and report), from the raw pool through pretraining, all ten
fine-tunes and the evaluation report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from assets.curation import curated_dataset, pool_shards, raw_pool, versioned_dataset
from assets.registry import evaluation_report
from assets.resources import DvcResource, PlatformResource
from assets.training import finetuned_models, pretrained_backbone, scratch_models
from tests.conftest import SMALL_RECIPE, make_workspace

RECIPE = {**SMALL_RECIPE, "synth.n_people": 16, "synth.workers": 1, "curation.workers": 1}
BIN = Path(sys.executable).parent


def _locked_md5(root: Path) -> dict[str, str]:
    """Output path -> md5 as `dvc.lock` records it."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


def _run_dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "SAPIENS2_WORKSPACE": str(root)}
    return subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True, timeout=1500)


def _repro(root: Path, *stages: str) -> subprocess.CompletedProcess:
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    assert _run_dvc(root, "init", "-q").returncode == 0
    return _run_dvc(root, "repro", *stages)


def test_dvc_repro_curates_with_the_bytes_the_dagster_assets_write(tmp_path: Path, monkeypatch) -> None:
    repro = make_workspace(tmp_path / "repro", RECIPE)
    proc = _repro(repro, "curate")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curated = repro / "data" / "curated"
    assert (curated / "curation_scores.png").is_file()
    assert sorted(p.name for p in (curated / "labels").glob("*.parquet")) == sorted(
        f"{t}.parquet" for t in ("albedo", "normal", "pointmap", "pose", "seg"))
    by_dvc = _locked_md5(repro)

    dagster = make_workspace(tmp_path / "dagster", RECIPE)
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(dagster))
    monkeypatch.setenv("SAPIENS2_DVC_REMOTE", str(tmp_path / "dvc-remote"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = dg.materialize([raw_pool, pool_shards, curated_dataset, versioned_dataset],
                         resources={"platform": PlatformResource(), "dvc": DvcResource()},
                         instance=dg.DagsterInstance.ephemeral())
    assert run.success
    by_dagster = _locked_md5(dagster)
    for out in ("data/raw", "data/curated"):
        assert by_dagster[out] == by_dvc[out], out


# Short fine-tunes: the point is equal bytes, not good models.
TRAINING = {**RECIPE, "finetune.steps": 6, "finetune.task_steps.pose": 6, "finetune.task_steps.seg": 6,
            "finetune.task_steps.pointmap": 6,
            "finetune.log_every": 3, "finetune.optim.warmup_steps": 2, "finetune.checkpoint.every_n_steps": 3}
TASKS = ("pose", "seg", "normal", "pointmap", "albedo")


@pytest.mark.slow
def test_dvc_repro_trains_with_the_bytes_the_dagster_assets_write(tmp_path: Path, monkeypatch) -> None:
    """Pretraining (2 ranks), the ten fine-tunes and evaluation: the same md5 per stage output
    either way (the report names the weights it scored, not the MLflow run that logged it).

    Every training launch and the evaluation run at one intra-op thread: at two, a launch's last
    bits do not always repeat even on one route (benchmarks/thread_determinism.py: the same pose
    fine-tune launched again gives other bytes now and then), so a difference would not say which
    route it came from."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read by threads_per_rank on either route
    repro = make_workspace(tmp_path / "repro", TRAINING)
    proc = _repro(repro, "evaluate")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    dagster = make_workspace(tmp_path / "dagster", TRAINING)
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(dagster))
    monkeypatch.setenv("SAPIENS2_DVC_REMOTE", str(tmp_path / "dvc-remote"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    instance = dg.DagsterInstance.ephemeral()
    run = dg.materialize([raw_pool, pool_shards, curated_dataset, versioned_dataset, pretrained_backbone,
                          *finetuned_models, *scratch_models, evaluation_report],
                         resources={"platform": PlatformResource(), "dvc": DvcResource(),
                                    "pipes_subprocess_client": dg.PipesSubprocessClient()},
                         instance=instance, raise_on_error=False)
    assert run.success, [str(e.event_specific_data) for e in run.all_events if e.is_failure]
    outs = ["data/raw", "data/curated", "models/pretrain", *(f"models/{t}" for t in TASKS),
            *(f"models/scratch/{t}" for t in TASKS), "reports/eval"]
    by_dvc, by_dagster = _locked_md5(repro), _locked_md5(dagster)
    differ = sorted(out for out in outs if by_dagster[out] != by_dvc[out])
    # Each training launch logs the kernels and threads torch chose for it; the message says
    # which launch saw what.
    dagster_log = "\n".join(entry.user_message for entry in instance.all_logs(run.run_id))
    assert not differ, (f"outputs differ: {differ} ({_where_histories_part(repro, dagster, differ)}); kernels "
                        f"per launch, DVC: {_kernel_lines(proc.stdout)}, Dagster: {_kernel_lines(dagster_log)}")


def _where_histories_part(repro: Path, dagster: Path, differ: list[str]) -> dict[str, str]:
    """For each differing model, the first step whose logged loss differs, with both values."""
    parted = {}
    for out in differ:
        if not (repro / out / "history.json").is_file():
            continue
        a, b = (json.loads((root / out / "history.json").read_text())["loss"] for root in (repro, dagster))
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        parted[out] = "equal losses" if step is None else f"step {step}: DVC {a[step]!r}, Dagster {b[step]!r}"
    return parted


def _kernel_lines(log: str) -> list[str]:
    return sorted({line[line.index("["):] for line in log.splitlines() if " kernels, " in line and "[" in line})
