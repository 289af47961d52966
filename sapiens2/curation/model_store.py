"""Where curation model files come from: a local path the config names.

Curation never downloads weights at run time. Remote (``s3://``) models are fetched into a
local cache by the pipeline step before curation starts (`pipelines.common.model_cache`), so the
library opens local files only and needs no S3 client.
"""

from __future__ import annotations

from pathlib import Path


def resolve_model(uri: str | Path, *, field: str = "model") -> Path:
    """The local model file behind ``uri``; errors name ``field``."""
    text = str(uri)
    if "://" in text:
        raise ValueError(f"{field}: {text} is remote; fetch remote models into the local cache first "
                         "(pipelines.common.model_cache.fetch_remote_models, which the curate step runs)")
    path = Path(text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{field}: model file {path} does not exist" if not path.exists()
                                else f"{field}: {path} is not a file")
    return path.resolve()
