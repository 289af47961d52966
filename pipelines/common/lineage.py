"""Lineage of a training or evaluation run, and the rank-0 MLflow run that records it.

The dataset is named by DVC's hash of the bytes it holds when the step starts (`content_md5`,
equal to `dvc.lock`'s record while the folder is as committed; a difference is reported), the
backbone by `dvc.lock`'s record of the pretraining output, the Dagster run by the environment
the asset launches the step with.
`model_sha256` hashes a task model's files themselves: evaluation records it, registration and
promotion find "the weights that were evaluated" by it, whatever `dvc.lock` says meanwhile.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlflow

from pipelines.common import tracking
from pipelines.common.version import DvcError, DvcWorkspace, content_md5
from pipelines.common.workspace import Workspace


def dvc_hash(path: Path | None, ws: Workspace | None = None) -> str:
    """md5 that dvc.lock records for `path` ("untracked" if none, "none" for no path)."""
    if path is None:
        return "none"
    ws = ws or Workspace.from_env()
    try:
        return DvcWorkspace(ws.root).out_hash(str(Path(path).resolve().relative_to(ws.root)))
    except (DvcError, ValueError, KeyError, FileNotFoundError):
        return "untracked"


def data_hash(data_dir: Path | None, ws: Workspace) -> str:
    """`content_md5` of the dataset folder (what a step reads); a warning when `dvc.lock` records
    other bytes (the folder changed after `dvc commit`): the lineage then names what was read.
    A folder not on this machine (registering models whose data was never pulled) keeps DVC's record."""
    recorded = dvc_hash(data_dir, ws)
    if data_dir is None or not Path(data_dir).exists():
        return recorded
    actual = content_md5(data_dir)
    if recorded not in ("untracked", actual):
        print(f"warning: {data_dir} holds other bytes (md5 {actual}) than dvc.lock records ({recorded}); "
              "the lineage names the bytes read", flush=True)
    return actual


MODEL_FILES = ("model.json", "model.safetensors")  # a task model folder's content; the rest is logs


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_sha256(model_dir: Path) -> str:
    """sha256 over the names and bytes of a task model's files (`MODEL_FILES`)."""
    digest = hashlib.sha256()
    for name in MODEL_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a task model folder (needs {', '.join(MODEL_FILES)})")
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class Lineage:
    dagster_run_id: str
    data_md5: str
    backbone_md5: str
    git_commit: str

    @classmethod
    def from_env(cls, data_dir: Path, backbone_dir: Path | None = None, dagster_run_id: str | None = None) -> Lineage:
        """Hashes of the dataset (its bytes, in DVC's format) and backbone (as DVC recorded it)
        this run consumes; the Dagster run is `dagster_run_id` (an asset's own run) or
        `$DAGSTER_RUN_ID` (a program it launched)."""
        ws = Workspace.from_env()
        return cls(
            dagster_run_id=dagster_run_id or os.environ.get("DAGSTER_RUN_ID", "none"),
            data_md5=data_hash(data_dir, ws),
            backbone_md5=dvc_hash(backbone_dir, ws),
            git_commit=tracking.git_commit(ws.root),
        )

    def with_backbone_file(self, path: Path) -> Lineage:
        """This lineage naming its backbone by the file's content (`sha256:<hex>`): what a fine-tune
        from `finetune.init_checkpoint` (published weights DVC does not track) started from."""
        return replace(self, backbone_md5=f"sha256:{file_sha256(path)}")

    def resume_identity(self, recipe: dict[str, Any], world_size: int) -> dict[str, str]:
        """What a checkpoint must have been written with for this run to resume it: the recipe
        (leaving out how often it logs and saves), the data and backbone it reads, the world size
        (ZeRO shards the optimizer per rank). The Dagster run and the git commit may differ."""
        recipe = {k: v for k, v in recipe.items() if k not in ("log_every", "checkpoint")}
        return {"recipe_sha": tracking.config_sha(recipe), "data_md5": self.data_md5,
                "backbone_md5": self.backbone_md5, "world_size": str(world_size)}

    def tags(self, config: dict[str, Any]) -> dict[str, str]:
        return tracking.lineage_tags(
            self.dagster_run_id, self.data_md5, self.backbone_md5, self.git_commit, tracking.config_sha(config)
        )


class RankZeroTracker:
    """An MLflow run in `sapiens2/<stage>` opened on rank 0 only; a no-op on the other ranks."""

    def __init__(self, rank: int, stage: str, lineage: Lineage, config: dict[str, Any], run_name: str | None = None) -> None:
        self.enabled = rank == 0
        self.stage, self.lineage, self.config = stage, lineage, config
        self.run_name = run_name or stage
        self.run_id: str | None = None
        self._ctx = None

    def __enter__(self) -> RankZeroTracker:
        if self.enabled:
            self._ctx = tracking.start_stage_run(
                self.stage, self.run_name, self.lineage.tags(self.config), workspace_root=Workspace.from_env().root
            )
            run = self._ctx.__enter__()
            self.run_id = run.info.run_id
            tracking.log_config(self.config)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            mlflow.log_metrics(metrics, step=step)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled:
            mlflow.set_tags(tags)

    def log_artifacts(self, paths: list[Path], artifact_path: str | None = None) -> None:
        if self.enabled:
            for path in paths:
                mlflow.log_artifact(str(path), artifact_path=artifact_path)
