"""Where curation model files come from: a local path, or an S3 object cached on local disk.

Curation never downloads weights from the internet at run time; a model is a file the config
names. An ``s3://bucket/key`` is fetched once through the project's S3 client
(``pipelines.s3``: endpoint, credentials, retries) into ``$SAPIENS2_MODEL_CACHE`` (default
``~/.cache/sapiens2/models``), checked against the object (size, the MD5 ETag of single-part
objects, the ``sha256`` metadata ``pipelines.s3.upload_verified`` records), and renamed into
place only then, so a killed or corrupt download never leaves a file that looks complete.
Keys are taken as immutable: a cached file is reused without asking S3 again (workers start
offline and fast), so publish new weights under a new key.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

MODEL_CACHE_ENV = "SAPIENS2_MODEL_CACHE"


def model_cache_dir() -> Path:
    """``$SAPIENS2_MODEL_CACHE``, else ``~/.cache/sapiens2/models``."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "sapiens2" / "models").expanduser()


def resolve_model(uri: str | Path, *, field: str = "model", cache_dir: str | Path | None = None,
                  settings=None, s3=None) -> Path:
    """The local file behind ``uri`` (a path or ``s3://bucket/key``); errors name ``field``.

    ``settings`` (a ``pipelines.services.ServiceSettings``) and ``s3`` (a client) default to
    the environment's, as ``pipelines.s3.client`` builds them.
    """
    text = str(uri)
    if not text.startswith("s3://"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{field}: model file {path} does not exist" if not path.exists()
                                    else f"{field}: {path} is not a file")
        return path.resolve()
    return _fetch_s3(text, field, Path(cache_dir).expanduser() if cache_dir else model_cache_dir(), settings, s3)


def _fetch_s3(uri: str, field: str, cache: Path, settings, s3) -> Path:
    from botocore.exceptions import ClientError

    from pipelines.s3 import UploadVerificationError, client, download_problems, split_uri

    try:
        bucket, key = split_uri(uri)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    if not key:
        raise ValueError(f"{field}: {uri!r} names a bucket, not a model file")
    cache = cache.resolve()
    target = (cache / bucket / key).resolve()
    if cache not in target.parents:
        raise ValueError(f"{field}: {uri!r}: key leaves the model cache {cache}")
    if target.is_file():
        return target
    s3 = s3 or client(settings)
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"{field}: {uri} does not exist") from exc
        raise
    target.parent.mkdir(parents=True, exist_ok=True)
    # A unique temporary name in the same folder: concurrent workers never share a partial file,
    # and the rename is atomic, so the cache holds complete, checked files or nothing.
    fd, partial_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(fd)
    partial = Path(partial_name)
    try:
        s3.download_file(bucket, key, str(partial))
        problems = download_problems(partial, head)
        if problems:
            raise UploadVerificationError(f"{field}: download of {uri} failed verification: {'; '.join(problems)}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target
