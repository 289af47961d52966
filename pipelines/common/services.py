"""Where the shared services are: one settings object for the S3 endpoint, bucket, prefix,
credentials, the local stack's ports and the optional PostgreSQL DSN.

Values come from the environment first, then from a dotenv file: `$SAPIENS2_SETTINGS_FILE`, or
`infra/stack.env` (the loopback stack's defaults). An empty value means "not set", so a
production file can leave the endpoint empty (AWS) and the credentials to boto3's usual chain
(instance role, `~/.aws`). The same names (`AWS_*`) are the ones boto3, DVC and MLflow read, so
the environment `aws_env` builds is all a step or a server process needs.

The class is a pydantic-settings `BaseSettings` rather than hand-rolled parsing: each setting is
declared once with its type, variable name and default; the environment > file > default order is
the library's, not ours to keep right; and a bad value (`SAPIENS2_S3_PORT=abc`) fails in `load`
with a message naming the variable and where it came from instead of a bare `int()` error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.common.workspace import PROJECT_ROOT

DEFAULT_SETTINGS_FILE = PROJECT_ROOT / "infra" / "stack.env"
SETTINGS_FILE_ENV = "SAPIENS2_SETTINGS_FILE"
SECRET_KEYS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "SAPIENS2_MLFLOW_DB_DSN")


class ServiceSettings(BaseSettings):
    """The resolved settings; secrets are excluded from `repr` so they never reach a log line.

    Build it with `ServiceSettings.load()`. Constructing it directly takes keyword arguments by
    field name (`host=...`), and fields left out are still read from the environment (not the file).
    """

    model_config = SettingsConfigDict(
        case_sensitive=True,  # the variables are exactly the names below, as os.environ spells them
        env_ignore_empty=True,  # "" means not set, in the environment and in the file alike
        extra="ignore",  # stack.env and the environment hold many other variables
        frozen=True,  # shared between steps; derive changed copies with model_copy / with_endpoint
    )

    host: str = Field("127.0.0.1", validation_alias="SAPIENS2_HOST")
    s3_port: int = Field(9100, validation_alias="SAPIENS2_S3_PORT")
    mlflow_port: int = Field(5000, validation_alias="SAPIENS2_MLFLOW_PORT")
    dagster_port: int = Field(3000, validation_alias="SAPIENS2_DAGSTER_PORT")
    bucket: str = Field("sapiens2", validation_alias="SAPIENS2_S3_BUCKET")
    prefix: str = Field("", validation_alias="SAPIENS2_S3_PREFIX")
    region: str = Field("us-east-1", validation_alias="AWS_DEFAULT_REGION")
    s3_endpoint_url: str | None = Field(None, validation_alias="SAPIENS2_S3_ENDPOINT_URL")  # None: AWS
    access_key_id: str | None = Field(None, validation_alias="AWS_ACCESS_KEY_ID", repr=False)
    secret_access_key: str | None = Field(None, validation_alias="AWS_SECRET_ACCESS_KEY", repr=False)
    session_token: str | None = Field(None, validation_alias="AWS_SESSION_TOKEN", repr=False)  # STS
    mlflow_db_dsn: str | None = Field(None, validation_alias="SAPIENS2_MLFLOW_DB_DSN", repr=False)

    def __init__(self, **values: Any) -> None:
        # Keyword arguments by field name are mapped to the variable names here instead of turning
        # on pydantic's validate_by_name, which would also read a stray `host` or `prefix` variable.
        fields = type(self).model_fields
        super().__init__(**{(fields[k].validation_alias if k in fields else k): v for k, v in values.items()})

    @field_validator("prefix")
    @classmethod
    def _strip_slashes(cls, prefix: str) -> str:
        return prefix.strip("/")

    @classmethod
    def load(cls, path: str | Path | None = None) -> ServiceSettings:
        """The environment over `path` (default `$SAPIENS2_SETTINGS_FILE`, else `infra/stack.env`);
        a missing file contributes nothing. ValueError naming the variable for a bad value."""
        settings_file = Path(path or os.environ.get(SETTINGS_FILE_ENV) or DEFAULT_SETTINGS_FILE)
        try:
            return cls(_env_file=settings_file)
        except ValidationError as exc:
            raise ValueError(_describe_errors(exc, settings_file)) from None

    def key(self, *parts: str) -> str:
        """An object key under the configured prefix: key('dvc') -> '<prefix>/dvc'."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def s3_uri(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"

    def with_endpoint(self, endpoint_url: str | None) -> ServiceSettings:
        return self.model_copy(update={"s3_endpoint_url": endpoint_url})

    def aws_env(self) -> dict[str, str]:
        """The variables boto3, DVC (s3fs) and the MLflow server read for S3 access.

        `AWS_ENDPOINT_URL_S3` is botocore's own endpoint setting; `MLFLOW_S3_ENDPOINT_URL`
        is MLflow's. Credentials are included only when configured (else boto3's chain applies).
        """
        env = {"AWS_DEFAULT_REGION": self.region, "SAPIENS2_S3_BUCKET": self.bucket,
               "SAPIENS2_S3_PREFIX": self.prefix}
        if self.s3_endpoint_url:
            env.update({"SAPIENS2_S3_ENDPOINT_URL": self.s3_endpoint_url,
                        "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint_url,
                        "AWS_ENDPOINT_URL_S3": self.s3_endpoint_url})
        if self.access_key_id and self.secret_access_key:
            env.update({"AWS_ACCESS_KEY_ID": self.access_key_id,
                        "AWS_SECRET_ACCESS_KEY": self.secret_access_key})
            if self.session_token:
                env["AWS_SESSION_TOKEN"] = self.session_token
        return env


def _describe_errors(exc: ValidationError, settings_file: Path) -> str:
    """One line per bad value: the variable, its value unless secret, where it came from, and why.
    The error locations are the variable names because every field has its alias."""
    lines = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"])
        source = "the environment" if os.environ.get(name) else str(settings_file)
        value = "" if _is_secret(name) else f"={error['input']!r}"
        lines.append(f"{name}{value} (from {source}): {error['msg']}")
    return "invalid service settings: " + "; ".join(lines)


def _is_secret(key: str) -> bool:
    return key in SECRET_KEYS or "SECRET" in key or "PASSWORD" in key


def redact(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` safe to print: secret values replaced by '***'."""
    return {k: ("***" if _is_secret(k) else v) for k, v in env.items()}
