"""Resources: the run's typed configuration, DVC versioning and MLflow tracking.

Each is a small interface with one implementation per environment, chosen by configuration in
`definitions.py` (embedded defaults: a local DVC remote and a SQLite MLflow store in the workspace).
"""

from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field, PrivateAttr

from pipelines.common.config import PlatformConfig, load_config
from pipelines.common.launch import save_resolved
from pipelines.common.services import ServiceSettings
from pipelines.common.version import DvcWorkspace
from pipelines.common.workspace import Workspace


# Run tag of the jobs that write the shared workspace and registry: dagster.yaml (and the Helm
# values) let one such run go at a time. An op tag would not do: run limits read run tags.
WORKSPACE_WRITER = {"sapiens2/workspace": "writes"}


def _section(name: str) -> Any:
    keys = ", ".join(PlatformConfig.model_fields[name].annotation.model_fields)
    return Field(default=None, description=(
        f"overrides of the `{name}` section of params.yaml, nested as there (e.g. "
        f"{{deepspeed: {{zero_stage: 3}}}}); keys: {keys}. Empty: params.yaml's values."))


def dotted(prefix: str, value: Any) -> dict[str, Any]:
    """{"deepspeed": {"zero_stage": 3}} under "pretrain" -> {"pretrain.deepspeed.zero_stage": 3}:
    a nested override changes only the keys it names; a leaf or an empty mapping is one value."""
    if isinstance(value, dict) and value:
        return {key: leaf for name, sub in value.items() for key, leaf in dotted(f"{prefix}.{name}", sub).items()}
    return {prefix: value}


class PlatformResource(dg.ConfigurableResource):
    """The whole run config in the launchpad: one field per section of `PlatformConfig`, each
    holding overrides merged into the workspace's `params.yaml` (an empty field keeps its values).

    Every asset requires this resource, so an invalid value anywhere (unknown model size, ZeRO
    stage 4, negative steps, a misspelt key) fails while the first step starts, before any
    work, naming the field.
    """

    image_size: Optional[list[int]] = Field(default=None, description="[height, width] of every stage's input")
    keypoint_set: Optional[str] = Field(default=None, description="coco17 or sapiens308")
    raw_source: Optional[str] = Field(default=None, description="s3://bucket/prefix or a folder; empty: params.yaml's")
    synth: Optional[dict[str, Any]] = _section("synth")
    curation: Optional[dict[str, Any]] = _section("curation")
    pretrain: Optional[dict[str, Any]] = _section("pretrain")
    finetune: Optional[dict[str, Any]] = _section("finetune")
    evaluate: Optional[dict[str, Any]] = _section("evaluate")
    registry: Optional[dict[str, Any]] = _section("registry")

    _config: Optional[PlatformConfig] = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._config = self.resolve()

    @property
    def ws(self) -> Workspace:
        """$SAPIENS2_WORKSPACE or the project root: the same folder the launched programs use."""
        return Workspace.from_env()

    def overrides(self) -> dict[str, Any]:
        """The launchpad's values as dotted keys over params.yaml."""
        out: dict[str, Any] = {}
        for name in PlatformConfig.model_fields:
            value = getattr(self, name)
            if value is not None:
                out |= dotted(name, value) if isinstance(value, dict) else {name: value}
        return out

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
