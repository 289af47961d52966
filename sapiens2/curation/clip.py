"""The open_clip model the CLIP stages (``clip_stages``) and the ``clip`` embedder share.

The model is built from local files only: ``open_clip.create_model_and_transforms`` with the
architecture name and ``pretrained=<resolved checkpoint file>`` (safetensors, or a torch pickle
read with ``weights_only=True``; ``pretrained_image/text=False`` so no tower fetches base
weights). It is loaded once per process per (architecture, checkpoint) and shared by every
stage and the ``clip`` embedder naming it.

Sharing one embedding: ``ClipModel.embed_images`` remembers the arrays of its latest call
(holding references, so an ``id`` cannot be reused while remembered). ``FilterChain`` passes
the same decoded arrays to each stage and then to the embedder, so the second and later CLIP
stages, and the dedup/balance embedding of the survivors, cost no forward pass. Images must
not be modified in place between stages (no stage does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sapiens2.curation.config import ClipModelConfig
from sapiens2.curation.model_store import resolve_model

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


class ClipModel:
    """An open_clip model in eval mode with its inference transform and tokenizer."""

    def __init__(self, model: Any, preprocess: Any, tokenizer: Any) -> None:
        import torch

        self._torch, self.model, self.preprocess, self.tokenizer = torch, model, preprocess, tokenizer
        size = model.visual.preprocess_cfg.get("size", model.visual.image_size)
        # "shortest" resizing maps the short side onto the input, so it never needs more pixels.
        self.image_side = int(max(size) if isinstance(size, (tuple, list)) else size)
        self.logit_scale = float(model.logit_scale.detach().exp().reshape(-1)[0])
        with torch.inference_mode():
            self.dim = int(model.encode_image(torch.zeros(1, 3, *_pair(model.visual.image_size))).shape[-1])
        self._last: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._texts: dict[tuple[str, ...], np.ndarray] = {}
        self.images_encoded = 0  # images run through the image tower so far (tests, timing)

    def embed_images(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """(N, D) unit-norm float32 image embeddings; images of the previous call are not re-encoded."""
        from PIL import Image

        out: list[np.ndarray | None] = []
        for image in images:
            hit = self._last.get(id(image))
            out.append(hit[1] if hit is not None and hit[0] is image else None)
        missing = [i for i, vector in enumerate(out) if vector is None]
        if missing:
            torch = self._torch
            batch = torch.stack([self.preprocess(Image.fromarray(np.ascontiguousarray(images[i])))
                                 for i in missing])
            with torch.inference_mode():
                features = self.model.encode_image(batch, normalize=True).float().numpy()
            self.images_encoded += len(missing)
            for i, vector in zip(missing, features):
                out[i] = vector
        self._last = {id(image): (image, vector) for image, vector in zip(images, out)}
        return np.stack(out).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)

    def embed_texts(self, prompts: Sequence[str]) -> np.ndarray:
        """(len(prompts), D) unit-norm float32 text embeddings, computed once per prompt list."""
        key = tuple(prompts)
        if key not in self._texts:
            if not key:
                self._texts[key] = np.zeros((0, self.dim), np.float32)
            else:
                with self._torch.inference_mode():
                    features = self.model.encode_text(self.tokenizer(list(key)), normalize=True)
                self._texts[key] = features.float().numpy()
        return self._texts[key]


_TORCHVISION_STUBS: Any = None  # keeps the stub op schemas registered (a Library unregisters when collected)


def import_open_clip() -> Any:
    """``open_clip``, importable even when torchvision's C++ ops cannot load.

    open_clip imports torchvision for its image transforms. A torchvision wheel built for another
    torch variant (PyPI's CUDA build beside the CPU torch this project installs) loads no C++
    ops, and torchvision 0.28 then fails at import ("operator torchvision::nms does not exist")
    registering fake kernels for nms/qnms. Curation needs none of those ops: declare the two
    schemas without kernels (``torchvision.ops`` still refuses to run them) and import again.
    """
    global _TORCHVISION_STUBS
    import sys

    import torch

    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc) or _TORCHVISION_STUBS is not None:
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _TORCHVISION_STUBS = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            _TORCHVISION_STUBS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import open_clip

    return open_clip


def _pair(size: Any) -> tuple[int, int]:
    return (int(size[0]), int(size[1])) if isinstance(size, (tuple, list)) else (int(size), int(size))


_MODELS: dict[tuple[str, str, str], ClipModel] = {}


def load_clip(config: ClipModelConfig, field: str, user: str) -> ClipModel:
    """The process's model for ``config``; ``field`` ("curation.clip") and ``user`` ("stage
    'clip_filter'") name the config in errors."""
    if config.checkpoint is None:
        raise ValueError(f"{field}.checkpoint is required by {user}")
    checkpoint = resolve_model(config.checkpoint, field=f"{field}.checkpoint")
    if checkpoint.suffix not in CHECKPOINT_SUFFIXES:
        raise ValueError(f"{field}.checkpoint: {checkpoint} has suffix {checkpoint.suffix!r}; "
                         f"expected one of {CHECKPOINT_SUFFIXES}")
    arch = resolve_model(config.arch_config, field=f"{field}.arch_config") if config.arch_config else None
    key = (config.model_name, str(arch), str(checkpoint))
    if key not in _MODELS:
        _MODELS[key] = _build(config.model_name, arch, checkpoint, field)
    return _MODELS[key]


def _build(name: str, arch: Path | None, checkpoint: Path, field: str) -> ClipModel:
    import torch

    open_clip = import_open_clip()
    torch.set_num_threads(1)  # curation parallelises across worker processes
    if arch is not None:
        if arch.stem != name:
            raise ValueError(f"{field}.arch_config: {arch} registers architecture {arch.stem!r}, "
                             f"but {field}.model_name is {name!r}")
        try:
            arch_cfg = json.loads(arch.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{field}.arch_config: {arch} is not JSON: {exc}") from exc
        if not isinstance(arch_cfg, dict) or not {"embed_dim", "vision_cfg", "text_cfg"} <= set(arch_cfg):
            raise ValueError(f"{field}.arch_config: {arch} needs the keys embed_dim, vision_cfg and text_cfg")
        if open_clip.get_model_config(name) != arch_cfg:
            open_clip.add_model_config(arch)  # later config paths win, so this one is used
    if open_clip.get_model_config(name) is None:
        raise ValueError(f"{field}.model_name: {name!r} is not an open_clip architecture; give its model-config "
                         f"JSON as {field}.arch_config (built-in: {', '.join(open_clip.list_models()[:8])}, ...)")
    try:
        # torch >= 2.6 unpickles weights-only by default, so even open_clip's TypeError fallback
        # (a plain torch.load) runs no code from the file.
        model, _, preprocess = open_clip.create_model_and_transforms(
            name, pretrained=str(checkpoint), pretrained_image=False, pretrained_text=False,
            weights_only=True, device="cpu")
    except RuntimeError as exc:  # strict load_state_dict: missing/unexpected keys, shape mismatches
        raise ValueError(f"{field}.checkpoint: {checkpoint} does not fit architecture {name!r}: {exc}") from exc
    return ClipModel(model.eval(), preprocess, open_clip.get_tokenizer(name))
