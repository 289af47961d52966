"""Resumable DeepSpeed checkpoints and full-precision weight export.

Layout: `root/step_00001000/` (DeepSpeed's per-rank model and ZeRO optimizer files) and
`root/latest` naming the newest complete tag. DeepSpeed's own `latest` is written by rank 0
before the other ranks have necessarily finished their optimizer shards, so we write it
ourselves, atomically, only after `save_checkpoint` has returned on every rank; a job killed
mid-save therefore resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn

from sapiens2.train.config import CheckpointSection

_TAG = re.compile(r"^step_(\d{8})$")


def _tag(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Saves engine + client state every `every_n_steps` optimizer steps under `root`, keeps the
    newest `keep_last` checkpoints and resumes from the newest complete one.

    `client_state` carries everything else that must survive a restart (trainer counters, EMA
    teacher, metric history, ...) as plain picklable values; `step` counts completed optimizer
    steps, so a resumed loop continues at `range(step, total_steps)`.
    """

    def __init__(self, root: str | Path, every_n_steps: int, keep_last: int):
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError(f"every_n_steps ({every_n_steps}) and keep_last ({keep_last}) must be >= 1")
        self.root = Path(root)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last

    @classmethod
    def from_section(cls, root: str | Path, section: CheckpointSection) -> CheckpointManager:
        return cls(root, section.every_n_steps, section.keep_last)

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint after `step` completed optimizer steps."""
        return step > 0 and step % self.every_n_steps == 0

    def save(self, engine: deepspeed.DeepSpeedEngine, step: int, client_state: dict[str, Any]) -> None:
        """Collective: every rank calls it. Writes tag `step_{step:08d}`, then prunes old tags."""
        tag = _tag(step)
        state = {"sapiens2_step": step, "sapiens2_client_state": client_state}
        engine.save_checkpoint(str(self.root), tag=tag, client_state=state, save_latest=False)
        if dist.get_rank() == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(tag)
            os.replace(tmp, self.root / "latest")
            for old in self._tags()[: -self.keep_last]:
                shutil.rmtree(self.root / old)
        dist.barrier()

    def latest_step(self) -> int | None:
        """Step of the newest complete checkpoint, or None when there is none."""
        latest = self.root / "latest"
        if not latest.is_file():
            return None
        match = _TAG.match(latest.read_text().strip())
        if match is None:
            raise ValueError(f"{latest} does not name a step_XXXXXXXX tag")
        return int(match.group(1))

    def resume(self, engine: deepspeed.DeepSpeedEngine) -> tuple[int, dict[str, Any]] | None:
        """Collective: load the newest complete checkpoint into `engine` (weights, fp32 master
        weights, optimizer moments) and return (step, client_state); None when starting fresh.

        Under ZeRO-3 the engine must be freshly initialized (not yet trained or saved).
        """
        step = self.latest_step()
        if step is None:
            return None
        load_path, state = engine.load_checkpoint(str(self.root), tag=_tag(step))
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load {self.root / _tag(step)}")
        return state["sapiens2_step"], state["sapiens2_client_state"]

    def _tags(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _TAG.match(p.name))


def _gather_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Collective: the full value of one module tensor on every rank. Trainable parameters come
    from the optimizer's fp32 master weights (not the bf16 copies the forward pass uses); frozen
    parameters are gathered as stored, buffers are never partitioned."""
    is_param = isinstance(tensor, nn.Parameter)
    full = safe_get_full_fp32_param(tensor) if is_param else None
    if full is None:
        with deepspeed.zero.GatheredParameters([tensor] if is_param else []):
            full = tensor.detach().clone()
    return full.float() if full.is_floating_point() else full


def full_fp32_parameters(engine: deepspeed.DeepSpeedEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (name, full fp32 value on the engine's device) of every module parameter, on
    every rank, e.g. for an EMA teacher update, which under ZeRO-3 cannot read the partitioned
    `engine.module` parameters directly."""
    for name, param in engine.module.named_parameters():
        yield name, _gather_fp32(param)


def export_full_state_dict(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor] | None:
    """Collective: the module's full, un-partitioned state dict (fp32 for floating tensors) on
    CPU on rank 0, None elsewhere, for ZeRO 1, 2 and 3."""
    rank0 = dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    # keep_vars=True yields the Parameter objects themselves, which DeepSpeed maps to their
    # fp32 partitions; names follow state_dict(), so tied weights appear under every name.
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        full = _gather_fp32(tensor)
        if rank0:
            out[name] = full.cpu()
    return out if rank0 else None
