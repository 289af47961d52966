"""Serving: a debug-size model registered by `pipelines.register` and promoted into the production
registry is served by `mlflow models serve` (infra/serve_smoke.py) and answers an image request
with what the model itself computes; the server is gone afterwards."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from infra import serve_smoke
from pipelines.common import tracking
from pipelines.common.config import load_config
from pipelines.common.lineage import Lineage, model_sha256
from pipelines.common.model_registry import Production, Request
from pipelines.promote import promote
from pipelines.register import register_task
from pipelines.common.serving import load_task_model, predict_images
from pipelines.common.workspace import Workspace
from tests.conftest import make_workspace
from tests.unit.test_predict import SIZE, make_model_dir

RESULTS = {
    "pose": {"primary_metric": "AP", "higher_is_better": True, "metrics": {"AP": 0.2}, "baseline": {"AP": 0.0}},
    "seg": {"primary_metric": "mIoU", "higher_is_better": True, "metrics": {"mIoU": 0.3}, "baseline": {"mIoU": 0.1}},
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A workspace whose SQLite registry holds a promoted production champion for pose and seg."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from _registry(tmp_path_factory.mktemp("serve"), monkeypatch)


def _registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    ws_root = make_workspace(tmp_path / "ws", {"pretrain.arch": "sapiens2_debug", "image_size": list(SIZE)})
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(ws_root))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SAPIENS2_PRODUCTION_REGISTRY_URI", raising=False)
    previous_uri = mlflow.get_tracking_uri()
    uri = tracking.tracking_uri_for(ws_root)
    mlflow.set_tracking_uri(uri)
    tracking.ensure_experiment("registry", ws_root)
    config = load_config(ws_root / "params.yaml")
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    for task, result in RESULTS.items():
        (tmp_path / "models" / task).mkdir(parents=True)
        model_dir = make_model_dir(tmp_path / "models" / task, task)
        reg = register_task(config, {"task": task, **result, "model_sha256": model_sha256(model_dir)}, "split-1",
                            model_dir, f"md5-{task}",
                            Lineage("dagster-run", "data-md5", "backbone-md5", "abc123"))
        decision = promote(reg.model_name, reg.version, result["primary_metric"], True, "split-1", client=client,
                           production=Production.for_model(reg.model_name, client), request=Request(reason="serve test"))
        assert decision.promoted, decision.reason
    yield ws_root
    mlflow.set_tracking_uri(previous_uri)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_champion_served_answers_an_image_request(registry: Path, tmp_path: Path) -> None:
    image = serve_smoke.request_image(80, 60)  # not the model's 64x48: the served model resizes
    model_uri, tracking_uri = serve_smoke.champion("pose", Workspace.from_env())
    assert model_uri == "models:/sapiens2-pose-production@champion"
    assert tracking_uri == tracking.tracking_uri_for(registry)

    port = serve_smoke.free_port()
    with serve_smoke.served(model_uri, tracking_uri, tmp_path / "logs" / "pose.log", port=port) as base:
        served = serve_smoke.invoke(base, image[None])
        batch = serve_smoke.invoke(base, np.stack([image, image[::-1].copy()]))
        with pytest.raises(serve_smoke.ServeError, match="invocations -> 400"):
            serve_smoke.invoke(base, np.zeros((1, 8, 8, 4), dtype=np.uint8))  # 4 channels: refused by the signature
        # Floats in [0, 1] would be zeros under a uint8 schema (and a 200): refused, saying why.
        with pytest.raises(serve_smoke.ServeError, match="invocations -> 400.*multiply by 255"):
            serve_smoke.invoke(base, image[None].astype(np.float32) / 255.0)
        with pytest.raises(serve_smoke.ServeError, match="invocations -> 400.*1-64 images"):
            serve_smoke.invoke(base, np.zeros((65, 4, 4, 3), dtype=np.uint8))
        with pytest.raises(serve_smoke.ServeError, match="invocations -> 400"):
            serve_smoke.invoke(base, np.zeros((1, 0, 0, 3), dtype=np.uint8))  # an empty image
        with pytest.raises(serve_smoke.ServeError, match="invocations -> 400.*at most 4096 px a side"):
            serve_smoke.invoke(base, np.zeros((1, 4097, 1, 3), dtype=np.uint8))  # oversized
        assert np.array_equal(serve_smoke.invoke(base, image[None]), served)  # still up after every refusal
    assert not _listening(port)  # stopped by pid

    model, spec = load_task_model(registry.parent / "models" / "pose")
    expected = predict_images(model, "pose", image[None], tuple(spec["image_size"]))
    assert served.shape == (1, 17, 3)
    assert np.allclose(served, expected, atol=1e-4)
    assert batch.shape == (2, 17, 3) and np.allclose(batch[0], expected[0], atol=1e-4)
    assert "keypoints" in serve_smoke.check_output("pose", served, image[None], (-1, 17, 3))
    with pytest.raises(serve_smoke.ServeError, match="outside"):
        serve_smoke.check_output("pose", served + np.array([1000.0, 0, 0]), image[None], (-1, 17, 3))


def test_smoke_script_serves_each_champion(registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert serve_smoke.main(["--tasks", "seg", "--logs", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "seg       ok   (1, 64, 48)" in out
    # No champion for normal in this registry: reported as a failure, exit status 1.
    assert serve_smoke.main(["--tasks", "normal", "--logs", str(tmp_path / "logs")]) == 1
    assert "normal    FAILED" in capsys.readouterr().err

