"""Verified multipart checkpoint upload against a moto S3 server on a free loopback port:
parts and checksums, retries on 503s, the endpoint stopping mid-upload, a mismatch, no secret in logs."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from pathlib import Path

import pytest
from botocore.awsrequest import AWSResponse

from pipelines.common import s3 as s3mod
from pipelines.common.services import ServiceSettings

SECRET = "s3cr3t-never-in-logs-7f3a"
MIB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """A ThreadedMotoServer that can be stopped and restarted on the same port (moto's state
    lives in the process, so the bucket and unfinished uploads survive a restart)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._cls, self.port = ThreadedMotoServer, _free_port()
        self.server = None

    def start(self) -> None:
        self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture()
def moto_s3(request: pytest.FixtureRequest):
    pytest.importorskip("moto")
    moto = Moto()
    moto.start()
    settings = ServiceSettings(host="127.0.0.1", s3_port=moto.port, mlflow_port=0, dagster_port=0,
                               bucket=request.node.name.replace("_", "-")[:40].strip("-"), prefix="team/run1", region="us-east-1",
                               s3_endpoint_url=f"http://127.0.0.1:{moto.port}",
                               access_key_id="AKIDTEST", secret_access_key=SECRET)
    s3mod.client(settings).create_bucket(Bucket=settings.bucket)
    yield moto, settings
    moto.stop()


def _file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / f"ckpt_{size}.safetensors"
    path.write_bytes(hashlib.sha256(str(size).encode()).digest() * (size // 32) + b"x" * (size % 32))
    return path


def test_multipart_upload_is_verified_and_keyed_under_prefix(moto_s3, tmp_path: Path) -> None:
    _, settings = moto_s3
    path = _file(tmp_path, 17 * MIB + 123)
    stored = s3mod.upload_verified(path, "pretrain/ckpt.safetensors", settings, part_size=5 * MIB)
    assert stored.uri == f"s3://{settings.bucket}/team/run1/pretrain/ckpt.safetensors"
    assert stored.size == path.stat().st_size
    assert stored.etag.endswith("-4")  # 3 full 5 MiB parts + a remainder
    assert stored.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    body = s3mod.client(settings).get_object(Bucket=settings.bucket, Key="team/run1/pretrain/ckpt.safetensors")["Body"].read()
    assert body == path.read_bytes()


def test_small_file_single_part(moto_s3, tmp_path: Path) -> None:
    _, settings = moto_s3
    path = _file(tmp_path, 1000)
    stored = s3mod.upload_verified(path, "small.bin", settings, part_size=5 * MIB)
    assert stored.etag == hashlib.md5(path.read_bytes()).hexdigest()


def test_throttling_and_5xx_are_retried(moto_s3, tmp_path: Path) -> None:
    _, settings = moto_s3
    s3 = s3mod.client(settings)
    failures = {"left": 3, "sent": 0}

    def fail_some_parts(request, **_):
        failures["sent"] += 1
        if failures["left"] > 0:
            failures["left"] -= 1
            status, body = (503, b"<Error><Code>SlowDown</Code><Message>Reduce your request rate</Message></Error>")
            return AWSResponse(request.url, status, {}, _Raw(body))
        return None

    s3.meta.events.register("before-send.s3.UploadPart", fail_some_parts)
    path = _file(tmp_path, 11 * MIB)
    stored = s3mod.upload_verified(path, "throttled.bin", settings, part_size=5 * MIB, s3=s3)
    assert failures["left"] == 0 and failures["sent"] == 3 + 3  # 3 parts, 3 refused and retried
    assert stored.etag.endswith("-3") and stored.size == 11 * MIB


def _outage_after_first_part(moto: Moto, s3) -> dict[str, bool]:
    """Stop the endpoint once the first part is stored and restart it 1.5 s later; the returned
    dict's "done" says whether that happened."""
    outage = {"done": False}

    def stop_after_first_part(**_):
        if not outage["done"]:
            outage["done"] = True
            moto.stop()
            threading.Timer(1.5, moto.start).start()

    s3.meta.events.register("after-call.s3.UploadPart", stop_after_first_part)
    return outage


def test_endpoint_stopped_mid_upload_then_restarted(moto_s3, tmp_path: Path) -> None:
    moto, settings = moto_s3
    s3 = s3mod.client(settings)
    outage = _outage_after_first_part(moto, s3)
    path = _file(tmp_path, 16 * MIB)
    stored = s3mod.upload_verified(path, "outage.bin", settings, part_size=5 * MIB, s3=s3)
    assert outage["done"]
    assert stored.size == 16 * MIB and stored.etag.endswith("-4")
    listing = s3.list_objects_v2(Bucket=settings.bucket, Prefix="team/run1/")
    assert [o["Key"] for o in listing["Contents"]] == ["team/run1/outage.bin"]


def test_mismatch_deletes_the_object_and_raises(moto_s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, settings = moto_s3
    path = _file(tmp_path, 6 * MIB)
    real = s3mod.file_digests
    monkeypatch.setattr(s3mod, "file_digests", lambda p, n: (real(p, n)[0], "0" * 32 + "-2"))
    with pytest.raises(s3mod.UploadVerificationError, match="ETag"):
        s3mod.upload_verified(path, "bad.bin", settings, part_size=5 * MIB)
    assert "Contents" not in s3mod.client(settings).list_objects_v2(Bucket=settings.bucket, Prefix="team/run1/bad")


def test_no_secret_in_logs_or_repr(moto_s3, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, settings = moto_s3
    with caplog.at_level(logging.DEBUG):
        s3mod.upload_verified(_file(tmp_path, 6 * MIB), "logged.bin", settings, part_size=5 * MIB)
    assert "UploadPart" in caplog.text or "upload" in caplog.text.lower()  # debug logging was on
    assert SECRET not in caplog.text
    assert SECRET not in repr(settings)


class _Raw:
    """The minimal raw-body object botocore reads a short-circuited response from."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_):
        yield self._body


def test_checkpoint_store_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(s3mod.CHECKPOINT_STORE_ENV, raising=False)
    assert s3mod.checkpoint_store() is None
    monkeypatch.setenv(s3mod.CHECKPOINT_STORE_ENV, "s3://team-bucket/exp/42/checkpoints/")
    store = s3mod.checkpoint_store()
    assert (store.bucket, store.prefix) == ("team-bucket", "exp/42/checkpoints")
    assert store.s3_uri("pretrain", "model.safetensors") == "s3://team-bucket/exp/42/checkpoints/pretrain/model.safetensors"
    monkeypatch.setenv(s3mod.CHECKPOINT_STORE_ENV, "/local/folder")
    with pytest.raises(ValueError, match="SAPIENS2_CHECKPOINT_STORE.*s3://<bucket>"):
        s3mod.checkpoint_store()


def test_checkpoint_published_through_an_outage_has_its_manifest_last(moto_s3, tmp_path: Path) -> None:
    moto, settings = moto_s3
    s3 = s3mod.client(settings)
    outage = _outage_after_first_part(moto, s3)
    weights, spec = _file(tmp_path, 12 * MIB), tmp_path / "model.json"
    spec.write_text('{"task": "pose"}')
    ckpt = s3mod.publish_checkpoint([weights, spec], "finetune/pose/run-1", settings, s3=s3, part_size=5 * MIB,
                                    extra={"asset": "finetuned_pose"})
    assert outage["done"]
    assert ckpt.uri == f"s3://{settings.bucket}/team/run1/finetune/pose/run-1/checkpoint.json"
    manifest = s3mod.read_checkpoint(ckpt.uri, settings)
    assert manifest["asset"] == "finetuned_pose"
    assert [(f["name"], f["size"]) for f in manifest["files"]] == [(weights.name, 12 * MIB), ("model.json", 16)]
    assert manifest["files"][0]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    listing = s3.list_objects_v2(Bucket=settings.bucket, Prefix="team/run1/finetune/pose/run-1/")
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in listing["Contents"]) == sorted(
        [weights.name, "model.json", "checkpoint.json"])


def test_checkpoint_failing_part_way_leaves_no_record(moto_s3, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, settings = moto_s3
    real, calls = s3mod.upload_verified, []

    def second_upload_fails(path, key, *args, **kwargs):
        calls.append(key)
        if len(calls) == 2:
            raise s3mod.UploadVerificationError(f"s3://{settings.bucket}/{key}: size differs; object deleted")
        return real(path, key, *args, **kwargs)

    monkeypatch.setattr(s3mod, "upload_verified", second_upload_fails)
    first, second = _file(tmp_path, 6 * MIB), tmp_path / "model.json"
    second.write_text("{}")
    with pytest.raises(s3mod.UploadVerificationError, match="size differs"):
        s3mod.publish_checkpoint([first, second], "pretrain/run-2", settings, part_size=5 * MIB)
    s3 = s3mod.client(settings)
    assert s3.list_objects_v2(Bucket=settings.bucket, Prefix="team/run1/pretrain/").get("KeyCount") == 0
    with pytest.raises(FileNotFoundError, match="no checkpoint manifest"):
        s3mod.read_checkpoint(f"s3://{settings.bucket}/team/run1/pretrain/run-2/checkpoint.json", settings)
    with pytest.raises(FileNotFoundError, match="missing"):
        s3mod.publish_checkpoint([tmp_path / "absent.safetensors"], "pretrain/run-3", settings)


def test_a_failed_republish_leaves_no_manifest_naming_deleted_files(moto_s3, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A retried step republishes to its key; when that fails part-way its cleanup deletes objects
    the first manifest named, so the first manifest must already be gone."""
    _, settings = moto_s3
    weights, spec = _file(tmp_path, 1 * MIB), tmp_path / "model.json"
    spec.write_text("{}")
    first = s3mod.publish_checkpoint([weights, spec], "finetune/seg/run-4", settings)
    assert s3mod.read_checkpoint(first.uri, settings)["files"]

    def fails(path, key, *args, **kwargs):
        raise s3mod.UploadVerificationError(f"s3://{settings.bucket}/{key}: size differs; object deleted")

    monkeypatch.setattr(s3mod, "upload_verified", fails)
    with pytest.raises(s3mod.UploadVerificationError):
        s3mod.publish_checkpoint([weights, spec], "finetune/seg/run-4", settings)
    with pytest.raises(FileNotFoundError, match="no checkpoint manifest"):
        s3mod.read_checkpoint(first.uri, settings)
