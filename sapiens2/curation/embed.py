"""Image embeddings for deep-feature dedup and balancing, and faiss cosine near-duplicate search.

Embeddings are unit-norm float32 rows, so an inner product is a cosine similarity and faiss's
exact inner-product index answers "which pairs are at least this similar" directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import cv2
import faiss
import numpy as np

from sapiens2.curation.config import EmbeddingConfig


class Embedder(Protocol):
    """A batch of uint8 RGB images (each H, W, 3; sizes may differ) -> (N, D) unit-norm float32."""

    dim: int

    def __call__(self, images: Sequence[np.ndarray]) -> np.ndarray: ...


def _unit_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    # A flat image has a zero vector; leave it zero (similar to nothing) rather than divide by 0.
    return np.ascontiguousarray(x / np.where(norms > 0, norms, 1.0))


class TinyImageEmbedder:
    """Zero-mean ``side`` x ``side`` RGB thumbnail, unit norm (a correlation of thumbnails)."""

    def __init__(self, side: int = 16) -> None:
        self.side = self.input_side = side
        self.dim = 3 * side * side

    def __call__(self, images: Sequence[np.ndarray]) -> np.ndarray:
        if not images:
            return np.zeros((0, self.dim), np.float32)
        thumbs = np.stack([cv2.resize(image, (self.side, self.side), interpolation=cv2.INTER_AREA)
                           for image in images]).reshape(len(images), -1).astype(np.float32)
        return _unit_rows(thumbs - thumbs.mean(axis=1, keepdims=True))


class BackboneEmbedder:
    """CLS feature of a Sapiens2 backbone on a squashed ``input`` x ``input`` view, unit norm."""

    def __init__(self, config: EmbeddingConfig) -> None:
        import torch

        from sapiens2.model import build_backbone
        from sapiens2.model.checkpoint import load_checkpoint

        torch.set_num_threads(1)  # curation parallelises across worker processes
        torch.manual_seed(0)
        side = config.backbone_input
        self._torch = torch
        self.model = build_backbone(config.backbone_arch, img_size=(side, side), output="cls").eval()
        if config.backbone_weights is not None:
            load_checkpoint(self.model, config.backbone_weights)
        self.side = self.input_side = side
        with torch.no_grad():
            self.dim = int(self.model(torch.zeros(1, 3, side, side)).shape[-1])

    def __call__(self, images: Sequence[np.ndarray]) -> np.ndarray:
        torch = self._torch
        if not images:
            return np.zeros((0, self.dim), np.float32)
        batch = np.stack([cv2.resize(image, (self.side, self.side), interpolation=cv2.INTER_AREA)
                          for image in images]).astype(np.float32) / 255.0
        mean, std = np.float32([0.485, 0.456, 0.406]), np.float32([0.229, 0.224, 0.225])
        tensor = torch.from_numpy((batch - mean) / std).permute(0, 3, 1, 2).contiguous()
        with torch.no_grad():
            return _unit_rows(self.model(tensor).reshape(len(images), -1).numpy())


class ClipEmbedder:
    """The open_clip image embedding of ``config.clip``; shares the process's model (and the
    embeddings of the latest batch) with the CLIP stages when they name the same model."""

    def __init__(self, config: EmbeddingConfig) -> None:
        from sapiens2.curation.clip import load_clip
        from sapiens2.curation.config import ClipModelConfig

        self.model = load_clip(config.clip or ClipModelConfig(), "curation.embedding.clip", "embedder 'clip'")
        self.dim, self.input_side = self.model.dim, self.model.image_side

    def __call__(self, images: Sequence[np.ndarray]) -> np.ndarray:
        return _unit_rows(self.model.embed_images(images))


def build_embedder(config: EmbeddingConfig) -> Embedder:
    if config.embedder == "tiny_image":
        return TinyImageEmbedder(config.tiny_side)
    if config.embedder == "clip":
        return ClipEmbedder(config)
    return BackboneEmbedder(config)


def near_duplicate_pairs(embeddings: np.ndarray, min_cosine: float) -> list[tuple[int, int, float]]:
    """All (i, j, cosine) with i < j and cosine >= ``min_cosine``, sorted; exact faiss search."""
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    if len(embeddings) < 2:
        return []
    index = faiss.IndexFlatIP(embeddings.shape[1])
    index.add(embeddings)
    # range_search keeps results strictly above the radius; step just below the threshold.
    lims, sims, ids = index.range_search(embeddings, float(np.nextafter(np.float32(min_cosine), np.float32(-1))))
    pairs = set()
    for i in range(len(embeddings)):
        for j, sim in zip(ids[lims[i]:lims[i + 1]].tolist(), sims[lims[i]:lims[i + 1]].tolist()):
            if i < j and sim >= min_cosine:
                pairs.add((i, j, round(sim, 4)))
    return sorted(pairs)
