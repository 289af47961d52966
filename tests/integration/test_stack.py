"""The local stack through its CLI (`python -m infra.stack`): a service that dies at start is
reported with its log and nothing is left running; the whole stack starts healthy, MLflow
artifacts land in the S3 bucket, a taken port is refused, and `down` frees every port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import boto3
import mlflow
import pytest

from infra import health
from pipelines.common.services import ServiceSettings
from pipelines.common.workspace import PROJECT_ROOT
from tests.conftest import free_ports

SECRET = "stack-s3cr3t-4b9e"


def _port_free(port: int) -> bool:
    """Nothing listens there (connections left in TIME_WAIT by the stopped servers don't count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _stack_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    s3, mlf, dag = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_", "SAPIENS2_"))}
    env.update({
        "SAPIENS2_STACK_DIR": str(tmp_path / "stack"), "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "SAPIENS2_S3_PORT": str(s3), "SAPIENS2_MLFLOW_PORT": str(mlf), "SAPIENS2_DAGSTER_PORT": str(dag),
        "SAPIENS2_S3_BUCKET": "stack-test", "SAPIENS2_S3_PREFIX": "team", "AWS_SECRET_ACCESS_KEY": SECRET,
        **extra,
    })
    return env


def _stack(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.stack", *args], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_service_dying_at_start_is_reported_and_nothing_is_left(tmp_path: Path) -> None:
    # No PostgreSQL driver/server: the MLflow server exits while starting.
    env = _stack_env(tmp_path, SAPIENS2_MLFLOW_DB_DSN=f"postgresql://u:{SECRET}@127.0.0.1:1/db")
    result = _stack(env, "up", "--timeout", "60")
    assert result.returncode == 1
    assert "mlflow exited with status" in result.stderr and "last lines of" in result.stderr
    assert SECRET not in result.stdout
    assert _port_free(int(env["SAPIENS2_S3_PORT"]))  # the S3 server it had started was stopped
    assert "stopped" in _stack(env, "status").stdout
    assert _stack(env, "status").stdout.count("stopped") == 4


@pytest.mark.slow
def test_stack_up_artifacts_on_s3_port_taken_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _stack_env(tmp_path)
    ports = [int(env[k]) for k in ("SAPIENS2_S3_PORT", "SAPIENS2_MLFLOW_PORT", "SAPIENS2_DAGSTER_PORT")]
    try:
        started = _stack(env, "up")
        assert started.returncode == 0, started.stderr[-3000:]
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings = ServiceSettings.load()
        for name, check in health.CHECKS.items():
            ok, detail = check(settings)
            assert ok, (name, detail)
        assert "healthy" in _stack(env, "status").stdout

        exports = dict(line.removeprefix("export ").replace("'", "").split("=", 1)
                       for line in (tmp_path / "stack" / "env").read_text().splitlines())
        assert oct((tmp_path / "stack" / "env").stat().st_mode)[-3:] == "600"
        assert exports["SAPIENS2_DVC_REMOTE"] == "s3://stack-test/team/dvc"
        assert exports["SAPIENS2_CHECKPOINT_STORE"] == "s3://stack-test/team/checkpoints"
        mlflow.set_tracking_uri(exports["MLFLOW_TRACKING_URI"])
        mlflow.set_experiment("stack-test")
        with mlflow.start_run() as run:
            mlflow.log_param("lr", 0.1)
            mlflow.log_text("hello from the stack", "notes/hello.txt")
        s3 = boto3.client("s3", endpoint_url=exports["SAPIENS2_S3_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key=SECRET)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="stack-test", Prefix="team/mlflow/")["Contents"]]
        key = next(k for k in keys if k.endswith(f"{run.info.run_id}/artifacts/notes/hello.txt"))
        assert s3.get_object(Bucket="stack-test", Key=key)["Body"].read() == b"hello from the stack"

        clash = _stack({**env, "SAPIENS2_STACK_DIR": str(tmp_path / "other")}, "up", "--timeout", "30")
        assert clash.returncode == 1 and "is already in use" in clash.stderr

        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "stack" / "logs").glob("*.log"))
        assert "Serving dagster-webserver" in logs and SECRET not in logs
        assert SECRET not in started.stdout and "AWS_SECRET_ACCESS_KEY=***" in started.stdout
    finally:
        stopped = _stack(env, "down")
    assert stopped.returncode == 0 and "dagster-daemon" in stopped.stdout and "s3" in stopped.stdout
    assert all(_port_free(p) for p in ports)
    assert _stack(env, "status").stdout.count("stopped") == 4
