"""Remote curation models: `s3://` files named in a `CurationConfig`, fetched into a local cache
before curation runs, so the library (`sapiens2.curation`) only ever opens local files.

An object is fetched once through the project's S3 client (`pipelines.common.s3`: endpoint,
credentials, retries) into ``$SAPIENS2_MODEL_CACHE`` (default ``~/.cache/sapiens2/models``),
checked against the object (size, the MD5 ETag of single-part objects, the ``sha256`` metadata
`pipelines.common.s3.upload_verified` records), and renamed into place only then, so a killed or corrupt
download never leaves a file that looks complete. Beside each cached file a stamp records the
object's ETag; a later fetch asks S3 once (one try, short timeouts) and downloads again when the
object changed under its key, so a republished model is never scored with stale weights. When S3
does not answer, the cached copy is used and a warning says so (curation can run offline).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from pipelines.common.s3 import ONE_TRY, UploadVerificationError, client, download_problems, split_uri

MODEL_CACHE_ENV = "SAPIENS2_MODEL_CACHE"
log = logging.getLogger(__name__)


def model_cache_dir() -> Path:
    """``$SAPIENS2_MODEL_CACHE``, else ``~/.cache/sapiens2/models``."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "sapiens2" / "models").expanduser()


def fetch_model(uri: str, *, field: str = "model", cache_dir: str | Path | None = None, settings=None,
                s3=None) -> Path:
    """The cached local copy of ``s3://bucket/key``, downloaded and checked if not cached yet;
    errors name ``field``. ``settings``/``s3`` default to the environment's (`pipelines.common.s3.client`)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        bucket, key = split_uri(uri)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    if not key:
        raise ValueError(f"{field}: {uri!r} names a bucket, not a model file")
    cache = (Path(cache_dir).expanduser() if cache_dir else model_cache_dir()).resolve()
    target = (cache / bucket / key).resolve()
    if cache not in target.parents:
        raise ValueError(f"{field}: {uri!r}: key leaves the model cache {cache}")
    stamp = target.with_name(f".{target.name}.etag")
    if target.is_file() and stamp.is_file():
        try:
            head = (s3 or client(settings, ONE_TRY)).head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:  # offline, or the object is gone: the copy is what we have
            log.warning("%s: could not check %s against S3 (%s); using the cached copy %s", field, uri, exc, target)
            return target
        if head["ETag"] == stamp.read_text():
            return target
        log.warning("%s: %s changed since it was cached; downloading it again", field, uri)
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
    # Written after the file: a crash in between leaves no stamp, and the next fetch downloads again.
    stamp.write_text(head["ETag"])
    return target


def _localize(value: Any, field: str, fetch: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: _localize(v, f"{field}.{k}", fetch) for k, v in value.items()}
    if isinstance(value, list):
        return [_localize(v, f"{field}[{i}]", fetch) for i, v in enumerate(value)]
    if isinstance(value, str) and value.startswith("s3://"):
        return str(fetch_model(value, field=field, **fetch))
    return value


def fetch_remote_models(config: BaseModel, section: str = "curation", **fetch: Any) -> BaseModel:
    """`config` with every ``s3://`` value replaced by its cached local file (fetched now if
    needed); errors name the field (``curation.clip.checkpoint``). ``fetch`` goes to `fetch_model`."""
    local = _localize(config.model_dump(mode="json"), section, fetch)
    return type(config).model_validate(local)
