"""Health checks of the stack's services over HTTP; each returns (healthy, what it saw).

Dagster counts as healthy only once its code location has loaded (a broken import shows up
here, not later in the UI), and the daemon only once the webserver reports its required
daemons healthy (their heartbeats are recent).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable

import boto3
from botocore.config import Config

from pipelines.common.services import ServiceSettings

Check = Callable[[ServiceSettings], tuple[bool, str]]

LOCATIONS_QUERY = """{ workspaceOrError { __typename ... on Workspace { locationEntries {
  name loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
DAEMONS_QUERY = "{ instance { daemonHealth { allDaemonStatuses { daemonType required healthy } } } }"


def _get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(2000).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc)
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(getattr(exc, "reason", exc))


def graphql(settings: ServiceSettings, query: str, timeout: float = 10.0, variables: dict | None = None) -> dict:
    body = {"query": query, **({"variables": variables} if variables else {})}
    request = urllib.request.Request(
        f"http://{settings.host}:{settings.dagster_port}/graphql", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def s3_ready(settings: ServiceSettings) -> tuple[bool, str]:
    """The endpoint answers and the bucket exists (created here on first success)."""
    endpoint = settings.s3_endpoint_url or f"http://{settings.host}:{settings.s3_port}"
    status, detail = _get(f"{endpoint}/moto-api/") if not settings.s3_endpoint_url else (200, "")
    if status != 200:
        return False, f"GET {endpoint}: {detail or status}"
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=settings.region,
                      aws_access_key_id=settings.access_key_id, aws_secret_access_key=settings.secret_access_key,
                      config=Config(retries={"mode": "standard", "max_attempts": 2}))
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    if settings.bucket not in existing:
        s3.create_bucket(Bucket=settings.bucket)
    return True, f"bucket {settings.bucket}"


def mlflow_ready(settings: ServiceSettings) -> tuple[bool, str]:
    status, body = _get(f"http://{settings.host}:{settings.mlflow_port}/health")
    return status == 200, f"/health -> {status} {body[:80]}"


def dagster_ready(settings: ServiceSettings) -> tuple[bool, str]:
    status, body = _get(f"http://{settings.host}:{settings.dagster_port}/server_info")
    if status != 200:
        return False, f"/server_info -> {status} {body[:80]}"
    entries = graphql(settings, LOCATIONS_QUERY)["data"]["workspaceOrError"].get("locationEntries", [])
    for entry in entries:
        error = entry["locationOrLoadError"]
        if error and error["__typename"] == "PythonError":
            raise RuntimeError(f"code location {entry['name']} failed to load: {error['message'][:2000]}")
    loaded = bool(entries) and all(e["loadStatus"] == "LOADED" for e in entries)
    return loaded, f"code locations {[(e['name'], e['loadStatus']) for e in entries]}"


def daemon_ready(settings: ServiceSettings) -> tuple[bool, str]:
    statuses = graphql(settings, DAEMONS_QUERY)["data"]["instance"]["daemonHealth"]["allDaemonStatuses"]
    unhealthy = [s["daemonType"] for s in statuses if s["required"] and not s["healthy"]]
    return not unhealthy, f"unhealthy daemons {unhealthy}" if unhealthy else "all required daemons healthy"


CHECKS: dict[str, Check] = {"s3": s3_ready, "mlflow": mlflow_ready, "dagster": dagster_ready, "daemon": daemon_ready}
