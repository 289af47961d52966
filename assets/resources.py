"""Resources: the run's typed configuration, DVC versioning and MLflow tracking.

Each is a small interface with one implementation per environment, chosen by configuration in
`definitions.py` (embedded defaults: a local DVC remote and a SQLite MLflow store in the workspace).
"""

from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field, PrivateAttr

from pipelines.config import PlatformConfig, load_config
from pipelines.launch import save_resolved
from pipelines.services import ServiceSettings
from pipelines.version import DvcWorkspace
from pipelines.workspace import Workspace
from sapiens2.model.config import ARCHS


class PlatformResource(dg.ConfigurableResource):
    """The run config shown in the launchpad; a field left empty takes its `params.yaml` value.

    Every asset requires this resource, so an invalid value (unknown model size, ZeRO stage 4,
    negative steps) fails while the first step starts, before any work, naming the field.
    """

    arch: Optional[str] = Field(default=None, description=f"backbone size, one of {sorted(ARCHS)}")
    n_people: Optional[int] = Field(default=None, description="synthetic people in the raw pool")
    pretrain_steps: Optional[int] = Field(default=None, description="pretraining optimizer steps")
    finetune_steps: Optional[int] = Field(default=None, description="fine-tuning optimizer steps per task")
    zero_stage: Optional[int] = Field(default=None, description="DeepSpeed ZeRO stage of pretraining (1, 2 or 3)")
    world_size: Optional[int] = Field(default=None, description="pretraining ranks")
    micro_batch_size: Optional[int] = Field(default=None, description="pretraining samples per rank per step")
    grad_accum_steps: Optional[int] = Field(default=None, description="pretraining micro-batches per optimizer step")
    init_checkpoint: Optional[str] = Field(
        default=None, description="fine-tune from this published backbone (.safetensors/.pth) instead of our pretraining"
    )

    _config: Optional[PlatformConfig] = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._config = self.resolve()

    @property
    def ws(self) -> Workspace:
        """$SAPIENS2_WORKSPACE or the project root: the same folder the launched programs use."""
        return Workspace.from_env()

    def overrides(self) -> dict[str, Any]:
        fields = {
            "pretrain.arch": self.arch,
            "synth.n_people": self.n_people,
            "pretrain.steps": self.pretrain_steps,
            "finetune.steps": self.finetune_steps,
            "pretrain.deepspeed.zero_stage": self.zero_stage,
            "pretrain.deepspeed.world_size": self.world_size,
            "pretrain.deepspeed.micro_batch_size": self.micro_batch_size,
            "pretrain.deepspeed.grad_accum_steps": self.grad_accum_steps,
            "finetune.init_checkpoint": self.init_checkpoint,
        }
        return {key: value for key, value in fields.items() if value is not None}

    def resolve(self) -> PlatformConfig:
        return load_config(self.ws.params_file, self.overrides())

    @property
    def config(self) -> PlatformConfig:
        if self._config is None:
            self._config = self.resolve()
        return self._config

    def write_config(self, path: Path) -> Path:
        """Save the resolved config where a launched program (and a later reader) finds it."""
        return save_resolved(self.config.to_dict(), path)


class DvcResource(dg.ConfigurableResource):
    """Versions stage outputs with DVC and pushes them to the remote (local folder or S3)."""

    remote_url: str = Field(default="", description="DVC remote; empty = $SAPIENS2_DVC_REMOTE or <workspace>/.dvc-storage")
    push: bool = True

    def repo(self, ws: Workspace) -> DvcWorkspace:
        remote = self.remote_url or ws.dvc_remote
        # An S3 remote on MinIO/moto needs its endpoint; on AWS it is None and DVC uses AWS's.
        endpoint = ServiceSettings.load().s3_endpoint_url if remote.startswith("s3://") else None
        repo = DvcWorkspace(ws.root)
        repo.ensure_initialised(remote, endpoint_url=endpoint)
        return repo

    def commit(self, ws: Workspace, stage: str, out: Path) -> str:
        """Record `stage`'s outputs in dvc.lock + cache, push them, return the md5 of `out`."""
        repo = self.repo(ws)
        repo.commit_stage(stage)
        if self.push:
            repo.push([stage])
        return repo.out_hash(str(out.relative_to(ws.root)))
