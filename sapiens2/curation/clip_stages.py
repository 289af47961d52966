"""CLIP stages: prototype filter (``clip_filter``), photo realism (``realism``) and an aesthetic head
(``aesthetic``), each reading the one open_clip image embedding an image gets (``clip.ClipModel``),
plus the checked loaders of their prototype arrays and aesthetic head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sapiens2.curation.clip import load_clip
from sapiens2.curation.config import CurationConfig
from sapiens2.curation.model_store import resolve_model
from sapiens2.curation.registry import Stage, register


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
