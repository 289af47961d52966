"""Resources: the run's typed configuration, DVC versioning and MLflow tracking.

Each is a small interface with one implementation per environment, chosen by configuration in
`definitions.py` (embedded defaults: a local DVC remote and a SQLite MLflow store in the workspace).
"""


from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field, PrivateAttr

from pipelines.config import PlatformConfig, load_config
from pipelines.version import DvcWorkspace
from pipelines.workspace import Workspace

_DEFAULTS = load_config(Workspace.from_env().params_file)


class PlatformResource(dg.ConfigurableResource):
    """The run config shown in the launchpad; defaults come from `params.yaml`.

    Every asset requires this resource, so an invalid value (unknown model size, ZeRO stage 4,
    negative steps) fails while the first step starts, before any work, naming the field.
    """

    arch: str = Field(default=_DEFAULTS.pretrain.arch, description="backbone size, e.g. sapiens2_tiny, sapiens2_0.4b")
    n_people: int = Field(default=_DEFAULTS.synth.n_people, description="synthetic people in the raw pool")
    pretrain_steps: int = _DEFAULTS.pretrain.steps
    finetune_steps: int = _DEFAULTS.finetune.steps
    zero_stage: int = Field(default=_DEFAULTS.pretrain.deepspeed.zero_stage, description="DeepSpeed ZeRO stage (1, 2 or 3)")
    world_size: int = Field(default=_DEFAULTS.pretrain.deepspeed.world_size, description="pretraining ranks")
    micro_batch_size: int = _DEFAULTS.pretrain.deepspeed.micro_batch_size
    grad_accum_steps: int = _DEFAULTS.pretrain.deepspeed.grad_accum_steps
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
        return {
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

    def resolve(self) -> PlatformConfig:
        return load_config(self.ws.params_file, self.overrides())

    @property
    def config(self) -> PlatformConfig:
        if self._config is None:
            self._config = self.resolve()
        return self._config

    def write_config(self, path: Path) -> Path:
        """Save the resolved config where a launched program (and a later reader) finds it."""
        import yaml

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        return path


class DvcResource(dg.ConfigurableResource):
    """Versions stage outputs with DVC and pushes them to the remote (local folder or S3)."""

    remote_url: str = Field(default="", description="DVC remote; empty = $SAPIENS2_DVC_REMOTE or <workspace>/.dvc-storage")
    push: bool = True

    def repo(self, ws: Workspace) -> DvcWorkspace:
        repo = DvcWorkspace(ws.root)
        repo.ensure_initialised(self.remote_url or ws.dvc_remote)
        return repo

    def commit(self, ws: Workspace, stage: str, out: Path) -> str:
        """Record `stage`'s outputs in dvc.lock + cache, push them, return the md5 of `out`."""
        repo = self.repo(ws)
        repo.commit_stage(stage)
        if self.push:
            repo.push([stage])
        return repo.out_hash(str(out.relative_to(ws.root)))

    def out_hash(self, ws: Workspace, out: Path) -> str:
        return DvcWorkspace(ws.root).out_hash(str(out.relative_to(ws.root)))
