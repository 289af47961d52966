"""MLflow conventions shared by every pipeline step.

Embedded default: a SQLite store `<workspace>/mlflow.db` with artifacts under
`<workspace>/mlartifacts`; `MLFLOW_TRACKING_URI` points the same code at a tracking server.
Each stage logs into its own experiment `sapiens2/<stage>`, and every run carries the lineage
tags of `lineage_tags` so a model version can be traced to its data, backbone, code and config.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import mlflow
from filelock import FileLock
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

EXPERIMENT_PREFIX = "sapiens2/"
# MLflow rejects longer param values; the full config is logged as an artifact anyway.
_MAX_PARAM_CHARS = 6000


def tracking_uri_for(workspace_root: str | Path) -> str:
    """Tracking URI for a workspace: `MLFLOW_TRACKING_URI` if set, else its SQLite file."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path(workspace_root).resolve() / 'mlflow.db'}"


def artifact_root_for(workspace_root: str | Path) -> Path:
    """Folder that holds the embedded store's artifacts, one sub-folder per stage."""
    return Path(workspace_root).resolve() / "mlartifacts"


class TrackingServerUnavailable(RuntimeError):
    """The MLflow tracking server a step needs does not answer; the message names its URI."""


def require_server(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, naming `uri`, when an http(s) tracking server does not answer `/health`.

    MLflow's client retries a refused connection with backoff for minutes and then reports a
    bare connection error; a step that cannot reach its server should say which one at once.
    """
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        raise TrackingServerUnavailable(
            f"MLflow tracking server {uri} is not reachable ({getattr(exc, 'reason', exc)}); "
            f"start it (`make stack-up`) or point MLFLOW_TRACKING_URI elsewhere, then rerun") from exc
    if status != 200:
        raise TrackingServerUnavailable(f"MLflow tracking server {uri} is not healthy: GET /health -> {status}")


def use_tracking_uri(uri: str) -> None:
    """Point this process's MLflow client at `uri`, leaving `MLFLOW_TRACKING_URI` as it was.

    `mlflow.set_tracking_uri` also writes the variable into `os.environ`, where `tracking_uri_for`
    reads it as the user's choice: in one process running steps of two workspaces in turn (Dagster's
    in-process executor, a test session) the second workspace's steps logged into the first's store.
    """
    exported = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if exported is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = exported


def create_embedded_store(uri: str) -> None:
    """Create a SQLite store's tables now, one process at a time: the first client of a new store
    runs its schema migration, and two steps opening the same new store at once (two fine-tunings
    launched together on a fresh workspace) race in it and one dies ("duplicate column name").
    Tracking servers and existing stores pass through at the cost of one query."""
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{db}.lock"):
        mlflow.MlflowClient(uri).search_experiments(max_results=1)


def _is_embedded(uri: str) -> bool:
    return uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri


def ensure_experiment(stage: str, workspace_root: str | Path | None = None) -> str:
    """Return the id of experiment `sapiens2/<stage>`, creating it when missing.

    With the embedded store its artifacts go under `<workspace>/mlartifacts/<stage>`; a
    tracking server chooses its own artifact location.
    """
    name = EXPERIMENT_PREFIX + stage
    existing = mlflow.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    location = None
    if workspace_root is not None and _is_embedded(mlflow.get_tracking_uri()):
        location = (artifact_root_for(workspace_root) / stage).as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except MlflowException as exc:
        # Another process (a parallel Dagster step) created it between our lookup and create.
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        return mlflow.get_experiment_by_name(name).experiment_id


@contextmanager
def start_stage_run(stage: str, run_name: str, tags: Mapping[str, str] | None = None, *,
                    workspace_root: str | Path | None = None,
                    nested: bool = False) -> Iterator[mlflow.ActiveRun]:
    """Open a run in `sapiens2/<stage>`, tagged with `stage` plus `tags`.

    When `workspace_root` is given the tracking URI is set from it first. System metrics (CPU,
    memory, GPU) are sampled when psutil is installed.
    """
    if workspace_root is not None:
        uri = tracking_uri_for(workspace_root)
        create_embedded_store(uri)
        use_tracking_uri(uri)
    experiment_id = ensure_experiment(stage, workspace_root)
    all_tags = {"stage": stage, **{k: str(v) for k, v in (tags or {}).items()}}
    system_metrics = importlib.util.find_spec("psutil") is not None
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=all_tags,
                          nested=nested, log_system_metrics=system_metrics) as run:
        yield run


def find_run(stage: str, tag: str, value: str, client: mlflow.MlflowClient | None = None) -> str:
    """Id of the newest run in `sapiens2/<stage>` tagged `tag = value`, or "" when there is none."""
    client = client or mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(EXPERIMENT_PREFIX + stage)
    if experiment is None:
        return ""
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{tag}` = '{value}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else ""


def flatten_config(cfg: Mapping, prefix: str = "") -> dict[str, str]:
    """Flatten nested mappings to dotted keys (`optim.lr`) with string values."""
    flat: dict[str, str] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, prefix=f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return flat


def config_sha(cfg: Mapping) -> str:
    """SHA-256 of the config's canonical JSON: the `config_sha` lineage tag."""
    canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def log_config(cfg: Mapping) -> dict[str, str]:
    """Log a resolved config on the active run as flattened params and as `config.json`."""
    flat = {k: v[:_MAX_PARAM_CHARS] for k, v in flatten_config(cfg).items()}
    mlflow.log_params(flat)
    mlflow.log_dict(dict(cfg), "config.json")
    return flat


def lineage_tags(dagster_run_id: str, data_hash: str, backbone_hash: str, git_commit: str,
                 config_hash: str) -> dict[str, str]:
    """The tags that tie a run or model version to what produced it."""
    return {
        "dagster_run_id": dagster_run_id,
        "dvc.data_md5": data_hash,
        "dvc.backbone_md5": backbone_hash,
        "git_commit": git_commit,
        "config_sha": config_hash,
    }


def git_commit(repo_root: str | Path | None = None) -> str:
    """`git rev-parse HEAD` of `repo_root` (default: cwd), or 'unknown' outside a repository."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root, capture_output=True,
                             text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
