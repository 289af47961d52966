"""Weight files: save as safetensors; load safetensors or (weights-only) torch pickles."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

# Keys under which training frameworks nest the weights ("teacher" for DINO-style SSL runs).
WRAPPER_KEYS = ("state_dict", "model", "teacher", "module")
# Name prefixes added by wrappers (DDP, torch.compile) or by the model the backbone sits in.
COMMON_PREFIXES = ("module.", "_orig_mod.", "model.", "teacher.", "backbone.", "encoder.")
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
Shape = tuple[int, ...]


class CheckpointMismatchError(ValueError):
    """A checkpoint's keys or shapes disagree with the module it is loaded into."""

    def __init__(
        self,
        path: Path,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, Shape, Shape]],
        target: str = "the model",
    ) -> None:
        self.path, self.missing, self.unexpected = path, missing, unexpected
        self.mismatched = mismatched
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
        if mismatched:
            shapes = [f"{k}: checkpoint {list(c)} vs model {list(m)}" for k, c, m in mismatched]
            parts.append(f"shape mismatches ({len(mismatched)}): {_listing(shapes)}")
        super().__init__(f"checkpoint {path} does not match {target}: " + "; ".join(parts))


class LoadReport(NamedTuple):
    """Keys the module kept at their current values, and checkpoint keys that were unused."""

    missing: list[str]
    unexpected: list[str]


def _listing(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


def save_checkpoint(module: nn.Module, path: str | Path) -> Path:
    """Writes ``module.state_dict()`` (parameters and persistent buffers) to a safetensors file."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"save_checkpoint writes safetensors; use a .safetensors path, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    # Written beside the target and renamed into place: a reader (or a kill) never sees half a file.
    partial = path.with_name(f".{path.name}.partial")
    save_file(state, str(partial), metadata={"format": "pt"})
    with open(partial, "rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, path)
    return path


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Reads a flat name -> tensor dict from .safetensors, or from .pth/.pt/.bin with
    ``weights_only=True`` (no arbitrary unpickling), unwrapping ``state_dict``/``model``/
    ``teacher``/``module`` nesting."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        return load_file(str(path), device="cpu")
    if path.suffix not in TORCH_SUFFIXES:
        raise ValueError(f"unsupported checkpoint type {path.suffix!r} ({path}); "
                         f"expected .safetensors or one of {TORCH_SUFFIXES}")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    while isinstance(obj, Mapping) and not all(isinstance(v, Tensor) for v in obj.values()):
        wrapper = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if wrapper is None:
            raise ValueError(f"{path}: no tensor dict found; top-level keys {sorted(obj)[:20]}")
        obj = obj[wrapper]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    return dict(obj)


def strip_prefixes(state: dict[str, Tensor], target: set[str]) -> dict[str, Tensor]:
    """Removes common prefixes so the names line up with ``target``.

    A prefix shared by every key (``module.``) is stripped unless that loses matches; a
    prefix shared by some keys selects that sub-dict when it matches more of ``target``
    (the ``backbone.*`` part of a task-model checkpoint).
    """
    # Each round either raises the overlap with target or shortens every key, so it ends.
    while state:
        overlap = len(state.keys() & target)
        best = None
        for prefix in COMMON_PREFIXES:
            sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            sub_overlap = len(sub.keys() & target)
            if sub_overlap > overlap or (sub and len(sub) == len(state) and sub_overlap == overlap):
                best, overlap = sub, sub_overlap
        if best is None:
            break
        state = best
    return state


def layout_diff(
    state: Mapping[str, Shape], own: Mapping[str, Shape]
) -> tuple[list[str], list[str], list[tuple[str, Shape, Shape]]]:
    """Missing names, unexpected names and (name, checkpoint shape, model shape) mismatches
    between a checkpoint's name -> shape layout and a module's."""
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    mismatched = [
        (k, tuple(state[k]), tuple(own[k]))
        for k in sorted(own.keys() & state.keys())
        if tuple(state[k]) != tuple(own[k])
    ]
    return missing, unexpected, mismatched


def load_checkpoint(module: nn.Module, path: str | Path, strict: bool = True) -> LoadReport:
    """Loads a checkpoint into ``module`` in place.

    Shape mismatches always raise :class:`CheckpointMismatchError`; with ``strict`` (default)
    missing or unexpected keys raise too, naming the file and every offending key.
    """
    path = Path(path)
    own = module.state_dict()
    state = strip_prefixes(read_state_dict(path), set(own))
    missing, unexpected, mismatched = layout_diff(
        {k: v.shape for k, v in state.items()}, {k: v.shape for k, v in own.items()}
    )
    if mismatched or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(path, missing, unexpected, mismatched)
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return LoadReport(missing, unexpected)
