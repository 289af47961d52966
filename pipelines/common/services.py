"""Where the shared services are: one settings object for the S3 endpoint, bucket, prefix,
credentials, the local stack's ports and the optional PostgreSQL DSN.

Values come from the environment first, then from a dotenv file: `$SAPIENS2_SETTINGS_FILE`, or
`infra/stack.env` (the loopback stack's defaults). An empty value means "not set", so a
production file can leave the endpoint empty (AWS) and the credentials to boto3's usual chain
(instance role, `~/.aws`). The same names (`AWS_*`) are the ones boto3, DVC and MLflow read, so
the environment `export_env` builds is all a step or a server process needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dotenv import dotenv_values

from pipelines.common.workspace import PROJECT_ROOT

DEFAULT_SETTINGS_FILE = PROJECT_ROOT / "infra" / "stack.env"
SECRET_KEYS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "SAPIENS2_MLFLOW_DB_DSN")


def _lookup(file_values: dict[str, str | None], key: str, default: str | None = None) -> str | None:
    value = os.environ.get(key)
    if value is None:
        value = file_values.get(key)
    return value if value else default


@dataclass(frozen=True)
class ServiceSettings:
    """The resolved settings; secrets are excluded from `repr` so they never reach a log line."""

    host: str
    s3_port: int
    mlflow_port: int
    dagster_port: int
    bucket: str
    prefix: str
    region: str
    s3_endpoint_url: str | None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)  # temporary (STS) credentials
    mlflow_db_dsn: str | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | Path | None = None) -> ServiceSettings:
        path = Path(path or os.environ.get("SAPIENS2_SETTINGS_FILE") or DEFAULT_SETTINGS_FILE)
        file_values = dotenv_values(path) if path.is_file() else {}

        def get(key: str, default: str | None = None) -> str | None:
            return _lookup(file_values, key, default)

        return cls(
            host=get("SAPIENS2_HOST", "127.0.0.1"),
            s3_port=int(get("SAPIENS2_S3_PORT", "9100")),
            mlflow_port=int(get("SAPIENS2_MLFLOW_PORT", "5000")),
            dagster_port=int(get("SAPIENS2_DAGSTER_PORT", "3000")),
            bucket=get("SAPIENS2_S3_BUCKET", "sapiens2"),
            prefix=(get("SAPIENS2_S3_PREFIX", "") or "").strip("/"),
            region=get("AWS_DEFAULT_REGION", "us-east-1"),
            s3_endpoint_url=get("SAPIENS2_S3_ENDPOINT_URL"),
            access_key_id=get("AWS_ACCESS_KEY_ID"),
            secret_access_key=get("AWS_SECRET_ACCESS_KEY"),
            session_token=get("AWS_SESSION_TOKEN"),
            mlflow_db_dsn=get("SAPIENS2_MLFLOW_DB_DSN"),
        )

    def key(self, *parts: str) -> str:
        """An object key under the configured prefix: key('dvc') -> '<prefix>/dvc'."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def s3_uri(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"

    def with_endpoint(self, endpoint_url: str | None) -> ServiceSettings:
        return ServiceSettings(**{**self.__dict__, "s3_endpoint_url": endpoint_url})

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


def redact(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` safe to print: secret values replaced by '***'."""
    return {k: ("***" if k in SECRET_KEYS or "SECRET" in k or "PASSWORD" in k else v) for k, v in env.items()}
