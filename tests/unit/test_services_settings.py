"""ServiceSettings: environment over the dotenv file over defaults, the variable names, errors that
name the variable, secrets kept out of repr, and the derived copies callers make."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelines.common import s3 as s3mod
from pipelines.common.services import DEFAULT_SETTINGS_FILE, ServiceSettings, redact

VARIABLES = ("SAPIENS2_HOST", "SAPIENS2_S3_PORT", "SAPIENS2_MLFLOW_PORT", "SAPIENS2_DAGSTER_PORT",
             "SAPIENS2_S3_BUCKET", "SAPIENS2_S3_PREFIX", "AWS_DEFAULT_REGION", "SAPIENS2_S3_ENDPOINT_URL",
             "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "SAPIENS2_MLFLOW_DB_DSN",
             "SAPIENS2_SETTINGS_FILE", s3mod.CHECKPOINT_STORE_ENV)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _settings_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.env"
    path.write_text(text)
    return path


def test_environment_wins_over_the_file(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = _settings_file(tmp_path, "SAPIENS2_S3_BUCKET=from-file\nSAPIENS2_S3_PORT=9200\n")
    clean_env.setenv("SAPIENS2_S3_BUCKET", "from-env")
    settings = ServiceSettings.load(path)
    assert settings.bucket == "from-env" and settings.s3_port == 9200


def test_file_from_the_environment_variable_and_defaults(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = _settings_file(tmp_path, "SAPIENS2_HOST=10.0.0.5\nSAPIENS2_S3_PREFIX=/team/run1/\n")
    clean_env.setenv("SAPIENS2_SETTINGS_FILE", str(path))
    settings = ServiceSettings.load()
    assert (settings.host, settings.prefix, settings.key("dvc")) == ("10.0.0.5", "team/run1", "team/run1/dvc")
    assert (settings.s3_port, settings.mlflow_port, settings.dagster_port) == (9100, 5000, 3000)
    assert (settings.bucket, settings.region, settings.s3_endpoint_url) == ("sapiens2", "us-east-1", None)
    assert settings.access_key_id is None and settings.mlflow_db_dsn is None


def test_a_missing_file_gives_the_defaults(tmp_path: Path) -> None:
    settings = ServiceSettings.load(tmp_path / "absent.env")
    assert (settings.host, settings.s3_port, settings.bucket, settings.prefix) == ("127.0.0.1", 9100, "sapiens2", "")


def test_the_repository_stack_file_loads() -> None:
    settings = ServiceSettings.load(DEFAULT_SETTINGS_FILE)
    assert settings.s3_endpoint_url is None and settings.access_key_id == "sapiens2-local"


def test_empty_values_mean_not_set(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = _settings_file(tmp_path, "SAPIENS2_S3_BUCKET=from-file\nSAPIENS2_S3_ENDPOINT_URL=\nSAPIENS2_MLFLOW_PORT=\n"
                                    "SAPIENS2_DAGSTER_PORT\n")
    clean_env.setenv("SAPIENS2_S3_BUCKET", "")  # empty in the environment: the file's value applies
    clean_env.setenv("SAPIENS2_S3_PORT", "")  # empty in both: the default
    settings = ServiceSettings.load(path)
    assert settings.bucket == "from-file" and settings.s3_endpoint_url is None
    assert (settings.s3_port, settings.mlflow_port, settings.dagster_port) == (9100, 5000, 3000)


def test_unknown_keys_and_field_names_are_not_read(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = _settings_file(tmp_path, "SAPIENS2_WORKSPACE=/workspace\nMLFLOW_TRACKING_URI=http://x\nbucket=nope\n")
    clean_env.setenv("host", "nope")  # only the SAPIENS2_*/AWS_* names are settings
    settings = ServiceSettings.load(path)
    assert settings.bucket == "sapiens2" and settings.host == "127.0.0.1"


def test_a_bad_port_names_the_variable_and_its_source(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = _settings_file(tmp_path, "SAPIENS2_MLFLOW_PORT=five\n")
    with pytest.raises(ValueError, match=rf"SAPIENS2_MLFLOW_PORT='five' \(from {path}\)"):
        ServiceSettings.load(path)
    clean_env.setenv("SAPIENS2_S3_PORT", "abc")
    with pytest.raises(ValueError, match=r"SAPIENS2_S3_PORT='abc' \(from the environment\): .*integer"):
        ServiceSettings.load(tmp_path / "absent.env")


def test_secrets_stay_out_of_repr(tmp_path: Path) -> None:
    path = _settings_file(tmp_path, "AWS_ACCESS_KEY_ID=AKIDSECRET\nAWS_SECRET_ACCESS_KEY=s3cr3t\n"
                                    "AWS_SESSION_TOKEN=tok3n\nSAPIENS2_MLFLOW_DB_DSN=postgresql://u:pw@db/m\n")
    settings = ServiceSettings.load(path)
    assert settings.secret_access_key == "s3cr3t" and isinstance(settings.mlflow_db_dsn, str)
    for text in (repr(settings), str(settings)):
        assert not any(secret in text for secret in ("AKIDSECRET", "s3cr3t", "tok3n", "pw@db"))


def test_settings_are_frozen_and_copies_change_only_what_they_name(clean_env: pytest.MonkeyPatch) -> None:
    settings = ServiceSettings(bucket="b", prefix="p", access_key_id="k", secret_access_key="s")
    with pytest.raises(ValidationError, match="frozen"):
        settings.bucket = "other"  # type: ignore[misc]
    moved = settings.with_endpoint("http://127.0.0.1:9")
    assert moved.s3_endpoint_url == "http://127.0.0.1:9" and settings.s3_endpoint_url is None
    assert moved.model_dump(exclude={"s3_endpoint_url"}) == settings.model_dump(exclude={"s3_endpoint_url"})

    assert s3mod.checkpoint_store(settings) is None
    clean_env.setenv(s3mod.CHECKPOINT_STORE_ENV, "s3://ckpts/team/run1/")
    store = s3mod.checkpoint_store(settings)
    assert (store.bucket, store.prefix, store.s3_uri("m")) == ("ckpts", "team/run1", "s3://ckpts/team/run1/m")
    assert store.secret_access_key == "s" and settings.bucket == "b"


def test_aws_env_for_a_typical_config(tmp_path: Path) -> None:
    path = _settings_file(tmp_path, "SAPIENS2_S3_BUCKET=sapiens2\nSAPIENS2_S3_PREFIX=team\n"
                                    "SAPIENS2_S3_ENDPOINT_URL=http://127.0.0.1:9100\nAWS_DEFAULT_REGION=eu-west-1\n"
                                    "AWS_ACCESS_KEY_ID=AKID\nAWS_SECRET_ACCESS_KEY=secret\n")
    env = ServiceSettings.load(path).aws_env()
    assert env == {
        "AWS_DEFAULT_REGION": "eu-west-1", "SAPIENS2_S3_BUCKET": "sapiens2", "SAPIENS2_S3_PREFIX": "team",
        "SAPIENS2_S3_ENDPOINT_URL": "http://127.0.0.1:9100", "MLFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:9100",
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9100", "AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret",
    }
    assert redact(env)["AWS_SECRET_ACCESS_KEY"] == "***" and redact(env)["AWS_ACCESS_KEY_ID"] == "AKID"
    # No endpoint (AWS) and no credentials (boto3's chain): only the location.
    bare = ServiceSettings.load(tmp_path / "absent.env").aws_env()
    assert bare == {"AWS_DEFAULT_REGION": "us-east-1", "SAPIENS2_S3_BUCKET": "sapiens2", "SAPIENS2_S3_PREFIX": ""}
