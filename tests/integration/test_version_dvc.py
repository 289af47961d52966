"""DvcWorkspace against the real dvc CLI: a local-directory remote, and S3 served by moto."""

from __future__ import annotations

import socket
from pathlib import Path

import boto3
import pytest

from pipelines.common.version import DvcError, DvcWorkspace, content_md5

DVC_YAML = """\
stages:
  produce:
    cmd: python produce.py
    outs:
      - data
      - model.bin
"""


def _produce(root: Path, version: str) -> None:
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "a.txt").write_text(f"alpha {version}\n")
    (root / "data" / "b.txt").write_text("beta\n")
    (root / "model.bin").write_bytes(b"\x00weights" + version.encode())


def _object(remote: Path, md5: str) -> Path:
    return remote / "files" / "md5" / md5[:2] / md5[2:]


@pytest.fixture()
def workspace(tmp_path: Path) -> DvcWorkspace:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "dvc.yaml").write_text(DVC_YAML)
    _produce(root, "v1")
    ws = DvcWorkspace(root)
    ws.ensure_initialised(tmp_path / "remote")
    return ws


def test_commit_push_status_and_hash_change(workspace: DvcWorkspace, tmp_path: Path) -> None:
    root, remote = workspace.root, tmp_path / "remote"
    # The remote is machine-specific: it goes to the git-ignored config.local, not the tracked config.
    assert (root / ".dvc" / "config.local").read_text().count("storage") >= 1
    assert "storage" not in (root / ".dvc" / "config").read_text()
    assert not (root / ".git").exists()

    hashes = workspace.commit_stage("produce")
    assert set(hashes) == {"data", "model.bin"}
    assert hashes["data"].endswith(".dir") and len(hashes["model.bin"]) == 32
    assert workspace.out_hash("data") == hashes["data"]
    assert workspace.out_hash(root / "model.bin") == hashes["model.bin"]
    # Lineage hashes the bytes themselves, in DVC's format: equal to the lock while unchanged.
    assert content_md5(root / "data") == hashes["data"] and content_md5(root / "model.bin") == hashes["model.bin"]
    assert workspace.status()["local"] == {}
    assert workspace.status()["cloud"] != {}  # committed but not pushed yet

    workspace.push(["produce"])
    assert _object(remote, hashes["data"]).is_file()
    assert _object(remote, hashes["model.bin"]).read_bytes() == (root / "model.bin").read_bytes()
    remote_files = {p for p in (remote / "files" / "md5").rglob("*") if p.is_file()}
    assert len(remote_files) == 4  # two data files, the .dir listing, model.bin
    assert workspace.status() == {"local": {}, "cloud": {}}

    _produce(root, "v2")
    assert "produce" in workspace.status()["local"]
    assert content_md5(root / "data") != hashes["data"]  # changed bytes, while dvc.lock still says v1
    changed = workspace.commit_stage("produce")
    assert changed["data"] != hashes["data"] and changed["model.bin"] != hashes["model.bin"]
    assert workspace.out_hash("data") == changed["data"] == content_md5(root / "data")
    _produce(root, "v1")
    assert workspace.commit_stage("produce") == hashes  # content-addressed, not time-based


def test_add_tracks_paths_outside_stages(workspace: DvcWorkspace, tmp_path: Path) -> None:
    ckpt = workspace.root / "backbone.safetensors"
    ckpt.write_bytes(b"tensor bytes")
    md5 = workspace.add(ckpt)
    assert workspace.out_hash("backbone.safetensors") == md5
    workspace.push(["backbone.safetensors.dvc"])
    assert _object(tmp_path / "remote", md5).read_bytes() == b"tensor bytes"


def test_errors_carry_dvc_stderr(workspace: DvcWorkspace) -> None:
    with pytest.raises(DvcError, match="no_such_stage"):
        workspace.commit_stage("no_such_stage")
    with pytest.raises(KeyError):
        workspace.out_hash("not_tracked")


def test_reinitialising_keeps_one_default_remote(workspace: DvcWorkspace, tmp_path: Path) -> None:
    workspace.ensure_initialised(tmp_path / "other_remote")
    config = (workspace.root / ".dvc" / "config.local").read_text()
    assert "other_remote" in config and config.count('remote "storage"') == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def s3_endpoint(monkeypatch: pytest.MonkeyPatch):
    """A moto S3 server on loopback, credentials in the env the dvc subprocess inherits."""
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_push_to_s3_endpoint(s3_endpoint: str, workspace: DvcWorkspace) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="sapiens2")
    workspace.ensure_initialised("s3://sapiens2/dvc", endpoint_url=s3_endpoint)
    hashes = workspace.commit_stage("produce")
    workspace.push()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sapiens2")["Contents"]}
    for md5 in hashes.values():
        assert f"dvc/files/md5/{md5[:2]}/{md5[2:]}" in keys
    assert workspace.status()["cloud"] == {}
    assert "endpointurl" in (workspace.root / ".dvc" / "config.local").read_text()
