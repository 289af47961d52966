"""Resumable DeepSpeed checkpoints and full-precision weight export.

Layout: `root/step_00001000/` (DeepSpeed's per-rank model and ZeRO optimizer files, plus our
`sapiens2.json`: the step and the run identity, written once every rank has saved, which marks
the tag complete) and `root/latest` naming the newest complete tag. DeepSpeed's own `latest` is
written by rank 0 before the other ranks have necessarily finished their optimizer shards, so we
write it ourselves, durably (fsync, atomic rename), after a barrier; a job killed mid-save
resumes from the previous complete checkpoint, and a `latest` lost to a crash falls back to the
newest tag with a completion record.

DeepSpeed loads its state with pickle, so a checkpoint is loaded only when every file in its tag
still has the sha256 the completion record noted at save time; a file swapped or changed since
(checkpoint folders are DVC outputs, shared and pulled) is refused before DeepSpeed opens it.

A manager built with an `identity` (recipe hash, data hash, world size: whatever must be equal
for a resume to continue the same run) refuses to resume a checkpoint recorded with another one,
naming the fields that differ, instead of silently continuing an old recipe; one built with
`restart_on_mismatch` deletes such a checkpoint and starts fresh instead (asked for by the Dagster
assets, whose new materialisation owns the folder, while a re-execution of the same run resumes).
"""

from __future__ import annotations

import hashlib
import json
import logging
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
RECORD = "sapiens2.json"
log = logging.getLogger(__name__)


class CheckpointMismatch(ValueError):
    """The checkpoint on disk belongs to a different run than the one asking to resume it."""


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves either the old or the new content."""
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _tag(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Saves engine + client state every `every_n_steps` optimizer steps under `root`, keeps the
    newest `keep_last` checkpoints and resumes from the newest complete one.

    `client_state` carries everything else that must survive a restart (trainer counters, EMA
    teacher, metric history, ...) as plain picklable values; `step` counts completed optimizer
    steps, so a resumed loop continues at `range(step, total_steps)`.
    """

    def __init__(self, root: str | Path, every_n_steps: int, keep_last: int, identity: dict[str, str] | None = None,
                 restart_on_mismatch: bool = False):
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError(f"every_n_steps ({every_n_steps}) and keep_last ({keep_last}) must be >= 1")
        self.root = Path(root)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.identity = identity
        self.restart_on_mismatch = restart_on_mismatch

    @classmethod
    def from_section(cls, root: str | Path, section: CheckpointSection, identity: dict[str, str] | None = None,
                     restart_on_mismatch: bool = False) -> CheckpointManager:
        return cls(root, section.every_n_steps, section.keep_last, identity, restart_on_mismatch)

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint after `step` completed optimizer steps."""
        return step > 0 and step % self.every_n_steps == 0

    def save(self, engine: deepspeed.DeepSpeedEngine, step: int, client_state: dict[str, Any]) -> None:
        """Collective: every rank calls it. Writes tag `step_{step:08d}`, then prunes old tags."""
        tag = _tag(step)
        state = {"sapiens2_step": step, "sapiens2_client_state": client_state}
        engine.save_checkpoint(str(self.root), tag=tag, client_state=state, save_latest=False)
        dist.barrier()  # every rank's shards are on disk before the tag is called complete
        if dist.get_rank() == 0:
            record = {"step": step, "identity": self.identity, "files": _file_hashes(self.root / tag)}
            write_durably(self.root / tag / RECORD, json.dumps(record))
            write_durably(self.root / "latest", tag)
            for old in self._tags()[: -self.keep_last]:
                shutil.rmtree(self.root / old)
        dist.barrier()

    def latest_step(self) -> int | None:
        """Step of the newest complete checkpoint, or None when there is none. A missing, empty
        or garbled `latest` (a crash while it was written) falls back to the newest tag with a
        completion record."""
        latest = self.root / "latest"
        match = _TAG.match(latest.read_text().strip()) if latest.is_file() else None
        if match is not None and (self.root / match.group(0)).is_dir():
            return int(match.group(1))
        complete = [t for t in self._tags() if (self.root / t / RECORD).is_file()] if self.root.is_dir() else []
        if latest.is_file() or complete:
            log.warning("%s: %s; falling back to %s", self.root,
                        f"{latest} names no checkpoint" if latest.is_file() else "no latest pointer",
                        complete[-1] if complete else "a fresh start")
        return int(_TAG.match(complete[-1]).group(1)) if complete else None

    def check_identity(self, step: int) -> None:
        """Raise CheckpointMismatch when the checkpoint at `step` was recorded by another run."""
        if self.identity is None:
            return
        record = self.root / _tag(step) / RECORD
        saved = json.loads(record.read_text()).get("identity") if record.is_file() else None
        if saved == self.identity:
            return
        if saved is None:
            differs = "it records no run identity"
        else:
            differs = "; ".join(f"{k}: saved {saved.get(k)!r}, now {self.identity.get(k)!r}"
                                for k in sorted(set(saved) | set(self.identity)) if saved.get(k) != self.identity.get(k))
        raise CheckpointMismatch(
            f"{self.root / _tag(step)} belongs to another run ({differs}); resuming needs the same recipe, "
            f"data and world size: write to a new output folder, delete {self.root} to start over, or launch "
            "with --restart-on-mismatch")

    def check_files(self, step: int) -> None:
        """Raise CheckpointMismatch unless the tag's files are exactly those its record hashed."""
        folder = self.root / _tag(step)
        saved = json.loads((folder / RECORD).read_text()).get("files")
        if saved is None:
            raise CheckpointMismatch(f"{folder}: its record holds no file hashes (written before checkpoints "
                                     "were verified), so its pickled DeepSpeed state is not loaded")
        now = _file_hashes(folder)
        changed = sorted(name for name in set(saved) | set(now) if saved.get(name) != now.get(name))
        if changed:
            raise CheckpointMismatch(f"{folder}: {', '.join(changed[:5])} not as saved (sha256 differs, added or "
                                     "missing); DeepSpeed's pickled state is loaded only from the files this "
                                     "platform wrote")

    def _check_files_on_rank_zero(self, step: int) -> None:
        """Collective `check_files`: rank 0 reads the files once and tells every rank the verdict."""
        verdict = [None]
        if dist.get_rank() == 0:
            try:
                self.check_files(step)
            except CheckpointMismatch as problem:
                verdict = [str(problem)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise CheckpointMismatch(verdict[0])

    def resume(self, engine: deepspeed.DeepSpeedEngine) -> tuple[int, dict[str, Any]] | None:
        """Collective: load the newest complete checkpoint into `engine` (weights, fp32 master
        weights, optimizer moments) and return (step, client_state); None when starting fresh.

        Under ZeRO-3 the engine must be freshly initialized (not yet trained or saved).
        """
        step = self.latest_step()
        if step is None:
            return None
        try:
            self.check_identity(step)
            self._check_files_on_rank_zero(step)
        except CheckpointMismatch as mismatch:
            if not self.restart_on_mismatch:
                raise
            log.warning("%s; deleting its checkpoints and starting fresh, as asked", mismatch)
            self._discard()
            return None
        load_path, state = engine.load_checkpoint(str(self.root), tag=_tag(step))
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load {self.root / _tag(step)}")
        return state["sapiens2_step"], state["sapiens2_client_state"]

    def _discard(self) -> None:
        """Collective: remove every checkpoint under `root` (every rank decided the same)."""
        dist.barrier()
        if dist.get_rank() == 0:
            for tag in self._tags():
                shutil.rmtree(self.root / tag)
            (self.root / "latest").unlink(missing_ok=True)
        dist.barrier()

    def _tags(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _TAG.match(p.name))


def _file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under a checkpoint tag but its completion record, by relative path."""
    hashes = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != RECORD:
            with open(path, "rb") as f:
                hashes[str(path.relative_to(folder))] = hashlib.file_digest(f, "sha256").hexdigest()
    return hashes


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
