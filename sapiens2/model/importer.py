"""Published Sapiens2 checkpoints: recognise the size from names and shapes, check, re-save.

The reference release ships one backbone file per size with exactly our state-dict names, so
importing is a strict layout check plus a re-save as plain safetensors (prefixes and
``state_dict``/``model``/``teacher`` wrappers removed), which fine-tuning then loads through
``finetune.init_checkpoint``. The layout check runs against a meta-device backbone, so a 5B
checkpoint is checked without allocating a second 5B model.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from sapiens2.model.backbone import Sapiens2Backbone, build_backbone
from sapiens2.model.checkpoint import (
    CheckpointMismatchError,
    Shape,
    layout_diff,
    read_state_dict,
    strip_prefixes,
)
from sapiens2.model.config import ARCHS


@functools.cache
def reference_layout(arch: str) -> tuple[dict[str, Shape], frozenset[str]]:
    """State-dict name -> shape of ``arch`` and the names that are parameters (not buffers)."""
    with torch.device("meta"):
        backbone = build_backbone(arch)
    shapes = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    return shapes, frozenset(name for name, _ in backbone.named_parameters())


def _arch_mismatch(path: Path, arch: str, shapes: dict[str, Shape]) -> CheckpointMismatchError:
    return CheckpointMismatchError(path, *layout_diff(shapes, reference_layout(arch)[0]), arch)


def infer_arch(state: dict[str, Tensor], path: str | Path = "<state dict>") -> str:
    """The ``ARCHS`` entry whose names and shapes equal ``state``'s (prefixes already stripped).

    When none matches exactly, raises :class:`CheckpointMismatchError` against the closest
    entry (most equal names and shapes), so the message lists what differs.
    """
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    scores = {}
    for arch in ARCHS:
        layout = reference_layout(arch)[0]
        if layout == shapes:
            return arch
        equal = sum(layout.get(k) == s for k, s in shapes.items())
        scores[arch] = equal - abs(len(layout) - len(shapes))
    raise _arch_mismatch(Path(path), max(scores, key=scores.get), shapes)


@dataclass(frozen=True)
class ImportReport:
    """What was read, which size it is, and where the re-saved copy went."""

    source: Path
    arch: str
    inferred: bool
    tensors: int
    parameters: int
    dtypes: dict[str, int] = field(default_factory=dict)
    output: Path | None = None

    def summary(self) -> str:
        how = "inferred from names and shapes" if self.inferred else "given"
        dtypes = ", ".join(f"{n} {d}" for d, n in sorted(self.dtypes.items()))
        lines = [
            f"checkpoint  {self.source}",
            f"arch        {self.arch} ({how})",
            f"tensors     {self.tensors} matched by name and shape; 0 missing, 0 unexpected",
            f"parameters  {self.parameters:,}",
            f"dtypes      {dtypes}",
            f"wrote       {self.output}" if self.output else "wrote       nothing (no --output)",
        ]
        return "\n".join(lines)


def _read_checked(path: Path, arch: str | None) -> tuple[dict[str, Tensor], str]:
    """The checkpoint's tensors under our names, and its size (``arch`` or the inferred one)."""
    if arch is not None and arch not in ARCHS:
        raise KeyError(f"unknown backbone {arch!r}; known: {sorted(ARCHS)}")
    known = set().union(*(reference_layout(a)[0] for a in ([arch] if arch else ARCHS)))
    state = strip_prefixes(read_state_dict(path), known)
    if arch is None:
        return state, infer_arch(state, path)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    if shapes != reference_layout(arch)[0]:
        raise _arch_mismatch(path, arch, shapes)
    return state, arch


def import_checkpoint(
    path: str | Path, arch: str | None = None, output: str | Path | None = None
) -> ImportReport:
    """Checks a reference-layout backbone checkpoint strictly and, with ``output``, writes it
    as safetensors in our layout (tensors keep their dtype; loading casts to the model's).

    ``arch`` defaults to the size whose layout the checkpoint has. Any missing, unexpected or
    mis-shaped name raises :class:`CheckpointMismatchError` naming every one of them.
    """
    path = Path(path)
    if output is not None and Path(output).suffix != ".safetensors":
        raise ValueError(f"output must be a .safetensors path, got {output}")
    state, found = _read_checked(path, arch)
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"format": "pt", "arch": found, "source": path.name}
        save_file({k: v.contiguous() for k, v in state.items()}, str(output), metadata=metadata)
    params = reference_layout(found)[1]
    return ImportReport(
        source=path,
        arch=found,
        inferred=arch is None,
        tensors=len(state),
        parameters=sum(v.numel() for k, v in state.items() if k in params),
        dtypes=dict(Counter(str(v.dtype).removeprefix("torch.") for v in state.values())),
        output=output,
    )


def load_pretrained(
    path: str | Path,
    arch: str | None = None,
    img_size: Sequence[int] | None = None,
    **overrides,
) -> Sapiens2Backbone:
    """A backbone built for the checkpoint's size (or ``arch``) with its weights loaded; extra
    keywords are :func:`build_backbone` options (``rope_dtype``, ``grad_checkpointing``, ...)."""
    state, found = _read_checked(Path(path), arch)
    backbone = build_backbone(found, img_size, **overrides)
    backbone.load_state_dict(state, strict=True)
    return backbone
