"""MLflow helper conventions: URIs, per-stage experiments, flattened config, lineage tags."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.common.tracking import (
    config_sha,
    flatten_config,
    git_commit,
    lineage_tags,
    log_config,
    start_stage_run,
    tracking_uri_for,
)


@pytest.fixture(autouse=True)
def _isolated_tracking(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    previous = mlflow.get_tracking_uri()
    yield
    mlflow.set_tracking_uri(previous)


def test_tracking_uri_default_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracking_uri_for(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_uri_for(tmp_path) == "http://mlflow:5000"


def test_stage_run_logs_config_and_tags(tmp_path: Path) -> None:
    cfg = {"optim": {"lr": 5e-4, "betas": [0.9, 0.999]}, "task": "pose", "deepspeed": {"zero": 2}}
    tags = lineage_tags("dg-1", "abc.dir", "def", "0123", config_sha(cfg))
    with start_stage_run("finetune", "pose-debug", tags, workspace_root=tmp_path) as run:
        flat = log_config(cfg)
    with start_stage_run("finetune", "pose-debug-2", workspace_root=tmp_path) as second:
        pass
    assert flat == {"optim.lr": "0.0005", "optim.betas": "[0.9, 0.999]", "task": "pose",
                    "deepspeed.zero": "2"}
    client = MlflowClient(tracking_uri_for(tmp_path))
    exp = client.get_experiment_by_name("sapiens2/finetune")
    assert exp.artifact_location == (tmp_path.resolve() / "mlartifacts" / "finetune").as_uri()
    assert second.info.experiment_id == exp.experiment_id
    data = client.get_run(run.info.run_id).data
    assert data.params["optim.lr"] == "0.0005"
    assert data.tags["stage"] == "finetune" and data.tags["dvc.data_md5"] == "abc.dir"
    assert set(tags) == {"dagster_run_id", "dvc.data_md5", "dvc.backbone_md5", "git_commit", "config_sha"}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "config.json" in artifacts


def test_each_workspace_logs_into_its_own_store_in_one_process(tmp_path: Path) -> None:
    """Steps of two workspaces in one process (Dagster's in-process executor, a test session):
    MLflow exported the first store's URI into `os.environ`, where `tracking_uri_for` took it for
    the user's choice and sent the second workspace's run into the first one's store."""
    first, second = tmp_path / "first", tmp_path / "second"
    with start_stage_run("finetune", "first-run", workspace_root=first):
        pass
    assert "MLFLOW_TRACKING_URI" not in os.environ
    with start_stage_run("finetune", "second-run", workspace_root=second):
        pass
    for workspace, name in ((first, "first-run"), (second, "second-run")):
        client = MlflowClient(tracking_uri_for(workspace))
        runs = client.search_runs([client.get_experiment_by_name("sapiens2/finetune").experiment_id])
        assert [run.info.run_name for run in runs] == [name]


def test_a_tracking_uri_the_user_exported_stays_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = f"sqlite:///{tmp_path.resolve() / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared)
    with start_stage_run("finetune", "run", workspace_root=tmp_path / "ws") as run:
        pass
    assert os.environ["MLFLOW_TRACKING_URI"] == shared
    assert MlflowClient(shared).get_run(run.info.run_id).info.run_name == "run"


def _open_stage_run(workspace: Path, name: str, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()
    with start_stage_run("finetune", name, workspace_root=workspace):
        pass


def test_steps_opening_a_new_store_at_once_all_run(tmp_path: Path) -> None:
    """Three processes opening a run on a store nobody has created yet, released together: without
    the lock around its creation, two or three of them died in the schema migration in each of 5
    tries."""
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(3)
    steps = [spawn.Process(target=_open_stage_run, args=(tmp_path, f"step-{i}", start)) for i in range(3)]
    for step in steps:
        step.start()
    for step in steps:
        step.join(timeout=120)
    assert [step.exitcode for step in steps] == [0, 0, 0]
    client = MlflowClient(tracking_uri_for(tmp_path))
    runs = client.search_runs([client.get_experiment_by_name("sapiens2/finetune").experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["step-0", "step-1", "step-2"]


def test_config_sha_is_order_independent() -> None:
    assert config_sha({"a": 1, "b": {"c": 2}}) == config_sha({"b": {"c": 2}, "a": 1})
    assert config_sha({"a": 1}) != config_sha({"a": 2})
    assert flatten_config({"a": {"b": {"c": 1}}}) == {"a.b.c": "1"}


def test_git_commit(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == "unknown"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head and len(head) == 40


def test_temporary_s3_credentials_keep_their_session_token(tmp_path, monkeypatch) -> None:
    from pipelines.common.s3 import client
    from pipelines.common.services import ServiceSettings, redact

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    settings_file = tmp_path / "stack.env"
    settings_file.write_text("AWS_ACCESS_KEY_ID=ASIAEXAMPLE\nAWS_SECRET_ACCESS_KEY=secret\nAWS_SESSION_TOKEN=token-123\n")
    settings = ServiceSettings.load(settings_file)
    env = settings.aws_env()
    assert env["AWS_SESSION_TOKEN"] == "token-123" and redact(env)["AWS_SESSION_TOKEN"] == "***"
    assert "token-123" not in repr(settings)
    assert client(settings)._request_signer._credentials.token == "token-123"


def test_a_published_backbone_is_recorded_by_its_bytes(tmp_path: Path) -> None:
    """A fine-tune from `init_checkpoint` (outside DVC) names what it started from by content, so
    its tags say which weights and a resume refuses changed ones."""
    import hashlib

    from pipelines.common.lineage import Lineage

    weights = tmp_path / "published.safetensors"
    weights.write_bytes(b"weights v1")
    lineage = Lineage("run", "data-md5", "none", "abc").with_backbone_file(weights)
    assert lineage.backbone_md5 == "sha256:" + hashlib.sha256(b"weights v1").hexdigest()
    before = lineage.resume_identity({"steps": 10}, 1)
    weights.write_bytes(b"weights v2")
    assert Lineage("run", "data-md5", "none", "abc").with_backbone_file(weights).resume_identity({"steps": 10}, 1) != before
