"""S3 access for checkpoints: a retrying client and a multipart upload verified before it counts.

A checkpoint is "recorded" (returned to the caller, who logs its URI) only after the object's
size and checksums match the local file. A multipart upload is atomic on S3: the object appears
only when the upload completes, so a failure mid-way leaves nothing under the key; boto3 aborts
the unfinished upload. Throttling, 5xx and connection errors are retried by botocore with
backoff (adaptive mode, also rate-limits the client); a whole upload that still fails (endpoint
gone for longer than the retries) is restarted a few times before giving up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from boto3.exceptions import S3UploadFailedError

from pipelines.common.services import ServiceSettings

log = logging.getLogger(__name__)

MIB = 1024 * 1024
RETRIES = Config(retries={"mode": "adaptive", "max_attempts": 8}, connect_timeout=5, read_timeout=60)
# One try, short timeouts: for a question whose answer is optional (is a cached copy still current?).
ONE_TRY = Config(retries={"mode": "standard", "max_attempts": 1}, connect_timeout=2, read_timeout=10)


class UploadVerificationError(RuntimeError):
    """The stored object does not match the local file (it has been deleted)."""


@dataclass(frozen=True)
class StoredObject:
    uri: str
    size: int
    sha256: str
    etag: str


def client(settings: ServiceSettings | None = None, config: Config = RETRIES):
    """An S3 client for the configured endpoint (None = AWS), by default with retries and backoff."""
    settings = settings or ServiceSettings.load()
    return boto3.client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.region,
        aws_access_key_id=settings.access_key_id, aws_secret_access_key=settings.secret_access_key,
        aws_session_token=settings.session_token, config=config,
    )


def file_digests(path: Path, part_size: int) -> tuple[str, str]:
    """(sha256 hex, S3 ETag) of a file uploaded in `part_size` parts.

    A multipart object's ETag is the MD5 of the parts' binary MD5s plus '-<parts>'; a
    single-part object's is the MD5 of its bytes. Computing it locally checks every part.
    """
    sha, part_md5s, whole = hashlib.sha256(), [], hashlib.md5()
    with path.open("rb") as fh:
        while chunk := fh.read(part_size):
            sha.update(chunk)
            whole.update(chunk)
            part_md5s.append(hashlib.md5(chunk).digest())
    if len(part_md5s) <= 1:
        return sha.hexdigest(), whole.hexdigest()
    return sha.hexdigest(), f"{hashlib.md5(b''.join(part_md5s)).hexdigest()}-{len(part_md5s)}"


def _verify(s3, bucket: str, key: str, size: int, sha256: str, etag: str) -> str:
    head = s3.head_object(Bucket=bucket, Key=key)
    problems = []
    if head["ContentLength"] != size:
        problems.append(f"size {head['ContentLength']} != local {size}")
    if head.get("Metadata", {}).get("sha256") != sha256:
        problems.append("sha256 metadata differs")
    stored_etag = head["ETag"].strip('"')
    if stored_etag != etag:
        problems.append(f"ETag {stored_etag} != local {etag}")
    if problems:
        s3.delete_object(Bucket=bucket, Key=key)
        raise UploadVerificationError(f"s3://{bucket}/{key}: {'; '.join(problems)}; object deleted")
    return stored_etag


def upload_verified(path: str | Path, key: str, settings: ServiceSettings | None = None, *,
                    part_size: int = 8 * MIB, attempts: int = 3, s3=None) -> StoredObject:
    """Upload `path` to `s3://<bucket>/<prefix>/<key>` in parts and verify size and checksums.

    Objects at or above `part_size` go up as a multipart upload of `part_size` parts (several
    in flight). Returns the stored object only once verified; raises otherwise.
    """
    settings = settings or ServiceSettings.load()
    s3 = s3 or client(settings)
    path, full_key = Path(path), settings.key(key)
    size = path.stat().st_size
    sha256, etag = file_digests(path, part_size)
    transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size, max_concurrency=4)
    for attempt in range(1, attempts + 1):
        try:
            s3.upload_file(str(path), settings.bucket, full_key, Config=transfer,
                           ExtraArgs={"Metadata": {"sha256": sha256}})
            break
        except (S3UploadFailedError, BotoCoreError, ClientError) as exc:
            if attempt == attempts:
                raise
            log.warning("upload of %s to s3://%s/%s failed (attempt %d/%d): %s; restarting",
                        path.name, settings.bucket, full_key, attempt, attempts, exc)
            time.sleep(2.0 * attempt)
    stored_etag = _verify(s3, settings.bucket, full_key, size, sha256, etag)
    return StoredObject(f"s3://{settings.bucket}/{full_key}", size, sha256, stored_etag)


# --- checkpoints ---------------------------------------------------------------------------------

CHECKPOINT_STORE_ENV = "SAPIENS2_CHECKPOINT_STORE"
MANIFEST = "checkpoint.json"


def checkpoint_store(settings: ServiceSettings | None = None) -> ServiceSettings | None:
    """Settings whose bucket and prefix are `$SAPIENS2_CHECKPOINT_STORE` (`s3://bucket/prefix`);
    None when it is unset (the embedded defaults keep checkpoints in the DVC remote only)."""
    uri = os.environ.get(CHECKPOINT_STORE_ENV, "").strip()
    if not uri:
        return None
    try:
        bucket, prefix = split_uri(uri)
    except ValueError as exc:
        raise ValueError(f"${CHECKPOINT_STORE_ENV}: {exc}") from None
    return (settings or ServiceSettings.load()).model_copy(update={"bucket": bucket, "prefix": prefix})


@dataclass(frozen=True)
class Checkpoint:
    uri: str  # the manifest's URI: the checkpoint exists once, and only once, this object does
    files: tuple[StoredObject, ...]


def publish_checkpoint(files: list[Path], key: str, settings: ServiceSettings, *, s3=None,
                       part_size: int = 8 * MIB, extra: dict | None = None) -> Checkpoint:
    """Upload `files` under `<prefix>/<key>/`, each verified, then write `checkpoint.json` last.

    The manifest (file names, sizes, sha256, ETags) is the record: a reader takes a prefix as a
    checkpoint only when it exists, so an upload that fails part-way never looks like one. On
    failure the objects already stored under the key are deleted and the error propagates.
    Republishing to a key (a retried step) deletes the old manifest before any file it names is
    replaced, so no record ever points at objects a failed republish removed.
    """
    s3 = s3 or client(settings)
    missing = [str(p) for p in files if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint files missing: {', '.join(missing)}")
    s3.delete_object(Bucket=settings.bucket, Key=settings.key(key, MANIFEST))  # no-op when there is none
    stored: list[StoredObject] = []
    try:
        for path in files:
            stored.append(upload_verified(path, f"{key}/{Path(path).name}", settings, part_size=part_size, s3=s3))
            log.info("checkpoint part %s: %d bytes verified", stored[-1].uri, stored[-1].size)
        manifest = {"files": [{"name": Path(o.uri).name, "size": o.size, "sha256": o.sha256, "etag": o.etag}
                              for o in stored], **(extra or {})}
        manifest_key = settings.key(key, MANIFEST)
        s3.put_object(Bucket=settings.bucket, Key=manifest_key, Body=json.dumps(manifest, indent=1).encode(),
                      ContentType="application/json")
    except Exception:
        for obj in stored:
            s3.delete_object(Bucket=settings.bucket, Key=obj.uri.removeprefix(f"s3://{settings.bucket}/"))
        raise
    return Checkpoint(f"s3://{settings.bucket}/{manifest_key}", tuple(stored))


def read_checkpoint(uri: str, settings: ServiceSettings | None = None, *, s3=None) -> dict:
    """The manifest of a published checkpoint (`s3://.../checkpoint.json`); FileNotFoundError naming
    the URI when there is none (the upload never finished)."""
    settings = settings or ServiceSettings.load()
    s3 = s3 or client(settings)
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            raise FileNotFoundError(f"{uri}: no checkpoint manifest (an unfinished or failed upload)") from exc
        raise
    return json.loads(body)


# --- raw pools -------------------------------------------------------------------------------------

def split_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'prefix') of `s3://bucket/prefix`; ValueError naming the URI otherwise."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"{uri!r}: expected s3://<bucket>[/<prefix>]")
    return bucket, prefix.strip("/")


def download_problems(path: Path, head: dict) -> list[str]:
    """What differs between a downloaded file and its object's `head_object` answer: size always,
    the MD5 for single-part objects (whose ETag is it), and the `sha256` metadata our uploads set."""
    size = path.stat().st_size
    etag = head["ETag"].strip('"')
    sha256, md5 = file_digests(path, max(size, 1))
    expected_sha = head.get("Metadata", {}).get("sha256")
    problems = [f"size {size} != {head['ContentLength']}"] if size != head["ContentLength"] else []
    if "-" not in etag and etag != md5:
        problems.append(f"MD5 {md5} != ETag {etag}")
    if expected_sha and expected_sha != sha256:
        problems.append("sha256 differs from the object's metadata")
    return problems


def download_prefix(uri: str, dest: str | Path, settings: ServiceSettings | None = None, *, s3=None,
                    progress: bool = True) -> list[Path]:
    """Copy every object under `s3://bucket/prefix` to `dest`, keeping paths relative to the prefix.

    Each file is checked against its object: size always, the MD5 for single-part objects, and
    the `sha256` metadata our uploads set. A key that would land outside `dest` ('..', absolute)
    is refused. Files are written under a temporary name and renamed once checked.
    """
    from tqdm import tqdm

    settings = settings or ServiceSettings.load()
    s3 = s3 or client(settings)
    bucket, prefix = split_uri(uri)
    dest = Path(dest).resolve()
    listing = [obj for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
               for obj in page.get("Contents", []) if not obj["Key"].endswith("/")]
    if not listing:
        raise FileNotFoundError(f"{uri}: no objects under this prefix")
    written = []
    for obj in tqdm(listing, desc=f"download {uri}", unit="file", disable=not progress):
        relative = obj["Key"][len(prefix) + 1:] if prefix else obj["Key"]
        target = (dest / relative).resolve()
        if dest not in target.parents:
            raise ValueError(f"s3://{bucket}/{obj['Key']}: key leaves the destination folder {dest}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        s3.download_file(bucket, obj["Key"], str(partial))
        problems = download_problems(partial, s3.head_object(Bucket=bucket, Key=obj["Key"]))
        if problems:
            partial.unlink()
            raise UploadVerificationError(f"s3://{bucket}/{obj['Key']}: {'; '.join(problems)}")
        partial.replace(target)
        written.append(target)
    return written
