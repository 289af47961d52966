"""MLflow tracking server down at registration: the `registered_models` asset fails with an error
naming the server, and once the server is back a rerun registers each model exactly once (a
second rerun reuses the versions instead of adding duplicates). Weights replaced after their
evaluation are refused; a task that failed its gate is held back alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from mlflow import MlflowClient

from assets.registry import registered_models
from assets.resources import DvcResource, PlatformResource
from pipelines.common.lineage import model_sha256
from tests.conftest import make_workspace
from tests.unit.test_predict import SIZE, make_model_dir

TASKS = {"seg": ("mIoU", 0.3, 0.1), "albedo": ("PSNR", 14.0, 8.0)}
RESOURCES = {"platform": PlatformResource(), "dvc": DvcResource()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mlflow_server(port: int, root: Path) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1:`port` (SQLite store, local artifacts), stopped by pid."""
    root.mkdir(parents=True, exist_ok=True)
    log = (root / "mlflow-server.log").open("a")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", (root / "artifacts").as_uri()],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (root / "mlflow-server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server not healthy in 120 s"
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fine-tuned (debug-size) seg and albedo models and an evaluation report, as registration finds them."""
    root = make_workspace(tmp_path / "ws", {"pretrain.arch": "sapiens2_debug", "image_size": list(SIZE)})
    for task in TASKS:
        (root / "models" / task).mkdir(parents=True)
        make_model_dir(root / "models" / task, task)
    report = {"split_id": "split-7", "tasks": [
        {"task": task, "primary_metric": metric, "higher_is_better": True, "metrics": {metric: value},
         "baseline": {metric: base}, "beats_baseline": True, "model_sha256": model_sha256(root / "models" / task)}
        for task, (metric, value, base) in TASKS.items()]}
    (root / "reports" / "eval").mkdir(parents=True)
    (root / "reports" / "eval" / "metrics.json").write_text(json.dumps(report))
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(root))
    return root


def _versions(client: MlflowClient, name: str) -> list[str]:
    return sorted(mv.version for mv in client.search_model_versions(f"name = '{name}'"))


@pytest.mark.slow
def test_registration_with_server_down_fails_clearly_and_rerun_does_not_duplicate(
        workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    down = dg.materialize([registered_models], resources=RESOURCES, raise_on_error=False)
    assert not down.success
    failures = [e.event_specific_data.error.to_string() for e in down.all_events if e.is_step_failure]
    assert failures and f"MLflow tracking server {uri} is not reachable" in failures[-1]  # in its cause chain
    retries = [e for e in down.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 2  # the asset's transient retry policy was used before failing

    with mlflow_server(port, tmp_path / "server") as served_uri:
        assert served_uri == uri
        first = dg.materialize([registered_models], resources=RESOURCES, raise_on_error=False)
        assert first.success
        again = dg.materialize([registered_models], resources=RESOURCES, raise_on_error=False)
        assert again.success
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        for task in TASKS:
            assert _versions(client, f"sapiens2-{task}") == ["1"]
            version = client.get_model_version(f"sapiens2-{task}", "1")
            assert version.tags["eval.split_id"] == "split-7" and version.tags["dvc.model_md5"]
            assert version.tags["model.sha256"] == model_sha256(workspace / "models" / task)
    assert _reused(first) == ["False"] * len(TASKS)
    assert _reused(again) == ["True"] * len(TASKS)


def _reused(result: dg.ExecuteInProcessResult) -> list[str]:
    """The `reused` column of the asset's `versions` metadata table (markdown)."""
    table = result.get_asset_materialization_events()[0].materialization.metadata["versions"].value
    return [line.split("|")[3].strip() for line in table.splitlines()[2:]]


@pytest.mark.slow
def test_a_task_that_failed_its_gate_is_not_registered(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.common import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = workspace / "reports" / "eval" / "metrics.json"
    report = json.loads(path.read_text())
    reason = "psnr=14 does not beat trivial:input_image 15 by the margin 0.5"
    report["tasks"][1] |= {"beats_baseline": False, "gate": {"passed": False, "reason": reason}}
    path.write_text(json.dumps(report))

    result = dg.materialize([registered_models], resources=RESOURCES, raise_on_error=False)
    assert result.success  # the gate holds back albedo alone
    metadata = result.get_asset_materialization_events()[0].materialization.metadata
    assert metadata["gated_out"].value == "albedo"
    assert reason in metadata["versions"].value
    uri = tracking.tracking_uri_for(workspace)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert [str(v) for v in _versions(client, "sapiens2-seg")] == ["1"]
    assert not client.search_registered_models(filter_string="name = 'sapiens2-albedo'")


def test_weights_replaced_after_evaluation_are_not_registered(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another run overwrote models/seg after this report scored it: registering it under the
    report's metrics would tag other weights with them."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    weights = workspace / "models" / "seg" / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    result = dg.materialize([registered_models], resources=RESOURCES, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).event_specific_data.error.to_string()
    assert f"{workspace / 'models' / 'seg'}: its weights" in failure and "not the ones the evaluation report scored" in failure
