"""Where every stage reads and writes: one folder layout shared by the CLI, dvc.yaml and Dagster.

The default workspace is the project root (so `dvc repro` and Dagster see the same outputs);
`SAPIENS2_WORKSPACE` points the same code at another folder (tests use a temporary one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def from_env(cls) -> Workspace:
        return cls(Path(os.environ.get("SAPIENS2_WORKSPACE", PROJECT_ROOT)).resolve())

    @property
    def params_file(self) -> Path:
        return self.root / "params.yaml"

    @property
    def raw_dir(self) -> Path:
        return self.root / "data" / "raw"

    @property
    def curated_dir(self) -> Path:
        return self.root / "data" / "curated"

    @property
    def curation_work_dir(self) -> Path:
        """Pool shards (``shards/``) and per-shard score files (``scores/``): the curation's
        resumable intermediate state, beside the dataset and not versioned with it."""
        return self.root / "data" / "curated.work"

    @property
    def pretrain_dir(self) -> Path:
        return self.root / "models" / "pretrain"

    def task_dir(self, task: str) -> Path:
        return self.root / "models" / task

    @property
    def scratch_root(self) -> Path:
        """From-scratch controls, one folder per task laid out like `task_dir`."""
        return self.root / "models" / "scratch"

    def scratch_dir(self, task: str) -> Path:
        return self.scratch_root / task

    @property
    def eval_dir(self) -> Path:
        return self.root / "reports" / "eval"

    @property
    def dvc_remote(self) -> str:
        return os.environ.get("SAPIENS2_DVC_REMOTE", str(self.root / ".dvc-storage"))
