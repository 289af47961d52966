"""CLIP stages: prototype filter (``clip_filter``), photo realism (``realism``) and an aesthetic head
(``aesthetic``), over one open_clip image embedding per image.

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
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sapiens2.curation.config import ClipModelConfig, CurationConfig
from sapiens2.curation.model_store import resolve_model
from sapiens2.curation.registry import Stage, register

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


def load_prototypes(uri: str, field: str, dim: int) -> np.ndarray:
    """Unit rows of a ``.npy`` of shape (K, dim) or (dim,); no pickles."""
    path = resolve_model(uri, field=field)
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"{field}: {path} is not a plain .npy array: {exc}") from exc
    array = np.asarray(array, np.float32)
    array = array[None] if array.ndim == 1 else array
    if array.ndim != 2 or array.shape[1] != dim or not len(array):
        raise ValueError(f"{field}: {path} has shape {np.shape(array)}; expected (K, {dim}) CLIP embeddings")
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    if not np.isfinite(array).all() or (norms == 0).any():
        raise ValueError(f"{field}: {path} holds a zero or non-finite vector")
    return array / norms


def load_head(uri: str, field: str, dim: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (weight, bias) layers of an aesthetic head, checked against embedding size ``dim``.

    Expected safetensors keys: ``weight`` (1, dim) and ``bias`` (1,) for a linear head, or
    ``layers.<i>.weight`` (out_i, in_i) and ``layers.<i>.bias`` (out_i,) applied in index
    order with no activation between, ``in_0 = dim`` and last ``out = 1`` (LAION's improved
    aesthetic predictor: convert its .pth with ``safetensors.torch.save_file``).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = resolve_model(uri, field=field)
    try:
        tensors = {k: v.float().numpy() for k, v in load_file(str(path)).items()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{field}: {path} is not a safetensors file: {exc}") from exc
    if "weight" in tensors or "bias" in tensors:
        prefixes = [""]
    else:
        indices = sorted({int(m.group(1)) for k in tensors if (m := re.fullmatch(r"layers\.(\d+)\.(weight|bias)", k))})
        if not indices:
            raise ValueError(f"{field}: {path}: missing key 'weight' (linear head) or 'layers.<i>.weight' "
                             f"(MLP head); found {sorted(tensors)[:10]}")
        prefixes = [f"layers.{i}." for i in indices]
    expected = {f"{p}{n}" for p in prefixes for n in ("weight", "bias")}
    if unexpected := sorted(set(tensors) - expected):
        raise ValueError(f"{field}: {path}: unexpected key(s) {unexpected[:10]}")
    layers, width = [], dim
    for prefix in prefixes:
        for name in ("weight", "bias"):
            if f"{prefix}{name}" not in tensors:
                raise ValueError(f"{field}: {path}: missing key '{prefix}{name}'")
        weight, bias = tensors[f"{prefix}weight"], tensors[f"{prefix}bias"]
        if weight.ndim != 2 or weight.shape[1] != width or bias.shape != (weight.shape[0],):
            raise ValueError(f"{field}: {path}: '{prefix}weight' {weight.shape} / '{prefix}bias' {bias.shape}; "
                             f"expected ({{out}}, {width}) / ({{out}},) (CLIP embedding size {dim})")
        layers.append((weight, bias))
        width = weight.shape[0]
    if width != 1:
        raise ValueError(f"{field}: {path}: the last layer '{prefixes[-1]}weight' has {width} outputs; expected 1")
    return layers


class _ClipStage(Stage):
    """A stage over the shared CLIP image embedding of ``CurationConfig.clip``."""

    def __init__(self, config: CurationConfig) -> None:
        self.config = config.clip
        self.clip = load_clip(config.clip, "curation.clip", f"stage {self.name!r}")
        self.input_side = self.clip.image_side


@register
class ClipFilterStage(_ClipStage):
    """Keeps images closer to a positive prototype than to any negative one (by ``min_margin``)."""

    name, reason, columns = "clip_filter", "clip_negative", ("clip_positive", "clip_negative", "clip_margin")

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(config)
        self.positive = self._prototypes("positive")
        self.negative = self._prototypes("negative")

    def _prototypes(self, side: str) -> np.ndarray:
        cfg = self.config
        prompts, file = getattr(cfg, f"{side}_prompts"), getattr(cfg, f"{side}_prototypes")
        rows = [self.clip.embed_texts(prompts)]
        if file is not None:
            rows.append(load_prototypes(file, f"curation.clip.{side}_prototypes", self.clip.dim))
        stacked = np.concatenate(rows)
        if not len(stacked):
            raise ValueError(f"curation.clip.{side}_prompts and curation.clip.{side}_prototypes are both empty; "
                             f"stage {self.name!r} needs at least one {side} prototype")
        return stacked

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        emb = self.clip.embed_images(images)
        pos, neg = (emb @ self.positive.T).max(axis=1), (emb @ self.negative.T).max(axis=1)
        return {"clip_positive": pos.tolist(), "clip_negative": neg.tolist(), "clip_margin": (pos - neg).tolist()}

    def judge(self, s: Mapping[str, Any]) -> str | None:
        if s["clip_margin"] < self.config.min_margin:
            return (f"CLIP margin {s['clip_margin']:.3f} < {self.config.min_margin} (positive "
                    f"{s['clip_positive']:.3f}, negative {s['clip_negative']:.3f})")
        return None


@register
class RealismStage(_ClipStage):
    """Photos, not drawings, cartoons, renders or paintings: the photo prompts' softmax share."""

    name, reason, columns = "realism", "not_realistic", ("realism",)

    def __init__(self, config: CurationConfig) -> None:
        super().__init__(config)
        cfg = self.config
        for field in ("photo_prompts", "non_photo_prompts"):
            if not getattr(cfg, field):
                raise ValueError(f"curation.clip.{field} is empty; stage {self.name!r} needs both prompt lists")
        self.prompts = self.clip.embed_texts((*cfg.photo_prompts, *cfg.non_photo_prompts))
        self.scale = cfg.realism_logit_scale or self.clip.logit_scale

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        logits = self.scale * (self.clip.embed_images(images) @ self.prompts.T)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        return {"realism": probs[:, :len(self.config.photo_prompts)].sum(axis=1).tolist()}

    def judge(self, s: Mapping[str, Any]) -> str | None:
        if s["realism"] < self.config.min_realism:
            return f"realism {s['realism']:.3f} < {self.config.min_realism}"
        return None


@register
class AestheticStage(_ClipStage):
    """A LAION-style aesthetic score predicted from the unit-norm CLIP image embedding."""

    name, reason, columns = "aesthetic", "low_aesthetic", ("aesthetic",)

    def __init__(self, config: CurationConfig) -> None:
        if config.aesthetic.head is None:
            raise ValueError(f"curation.aesthetic.head is required by stage {self.name!r}")
        super().__init__(config)
        self.min_score = config.aesthetic.min_score
        self.layers = load_head(config.aesthetic.head, "curation.aesthetic.head", self.clip.dim)

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        x = self.clip.embed_images(images)
        for weight, bias in self.layers:
            x = x @ weight.T + bias
        return {"aesthetic": x[:, 0].tolist()}

    def judge(self, s: Mapping[str, Any]) -> str | None:
        if s["aesthetic"] < self.min_score:
            return f"aesthetic {s['aesthetic']:.2f} < {self.min_score}"
        return None
