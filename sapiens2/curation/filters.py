"""The per-image filter chain: the configured stages in order, stopping at the first rejection.

Every image gets one row; the scores computed before it stopped are kept as evidence, the
rest stay empty (None), so a manifest reader can tell "not measured" from "measured low".
Deduplication and balancing need all survivors at once and run afterwards (``pipelines.curate``).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sapiens2.curation.config import CurationConfig
from sapiens2.data.decode import decode_image
from sapiens2.curation.embed import build_embedder
from sapiens2.curation.stages import build_stages

REASONS = ("unreadable", "too_small", "low_quality", "text_overlay", "no_person", "clip_negative", "not_realistic",
           "low_aesthetic", "unsafe", "head_pose", "duplicate", "over_represented")
SCORE_COLUMNS = ("width", "height", "short_side", "sharpness", "brightness", "clipped_fraction",
                 "text_score", "person_score", "num_persons", "person_area", "phash", "sha256")


def file_sha256(path: str | Path) -> str:
    """Content hash of the file's bytes: equal hashes are exact copies, whatever their names."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FilterChain:
    """Decode, score and judge files against a ``CurationConfig``, one batch at a time.

    Holds OpenCV detectors, so it is not picklable: build one per worker process.
    """

    def __init__(self, config: CurationConfig) -> None:
        self.config = config
        self.stages = build_stages(config)
        extra = [c for stage in self.stages for c in stage.columns if c not in SCORE_COLUMNS]
        self.columns = (*SCORE_COLUMNS, *dict.fromkeys(extra))
        self.embedder = build_embedder(config.embedding) if config.needs_embeddings else None
        needs = [stage.input_side for stage in self.stages]
        if self.embedder is not None:
            needs.append(getattr(self.embedder, "input_side", None))
        # Decode only as much as the hungriest consumer needs (JPEG draft mode); None = full size.
        self.decode_side = None if None in needs or not config.draft_decode else max(needs, default=None)

    def assess_batch(self, paths: Sequence[str | Path | bytes], seconds: Counter | None = None) -> list[dict[str, Any]]:
        """Manifest rows (without id, paths, dedup, cluster and split columns) for ``paths``
        (file paths, or the files' bytes as read from a pool shard).

        Each stage scores the images still alive as one batch, so batched model stages pay one
        call per batch, and rejected images are never scored by later (costlier) stages.
        ``seconds``, when given, accumulates the time spent per step: "decode" (hash + decode),
        each stage by name, and "embed".
        """
        seconds = Counter() if seconds is None else seconds
        started = time.perf_counter()
        rows = [dict.fromkeys(self.columns) | {"status": "kept", "reason": None, "detail": None} for _ in paths]
        images, sizes = {}, {}
        for i, path in enumerate(paths):
            try:
                rows[i]["sha256"] = hashlib.sha256(path).hexdigest() if isinstance(path, bytes) else file_sha256(path)
            except OSError as exc:
                rows[i] |= {"status": "quarantined", "reason": "unreadable", "detail": f"unreadable: {exc}"}
                continue
            decoded = decode_image(path, self.config.max_pixels, self.decode_side)
            if decoded.ok:
                images[i], sizes[i] = decoded.image, decoded.size
            else:
                rows[i] |= {"status": "quarantined", "reason": "unreadable", "detail": decoded.error}
        seconds["decode"] += time.perf_counter() - started
        for stage in self.stages:
            alive = list(images)
            if not alive:
                break
            started = time.perf_counter()
            scores = stage.score_decoded([images[i] for i in alive], [sizes[i] for i in alive])
            for k, i in enumerate(alive):
                rows[i].update({col: values[k] for col, values in scores.items()})
                detail = stage.judge(rows[i])
                if detail is not None:
                    rows[i] |= {"status": "rejected", "reason": stage.reason, "detail": detail}
                    del images[i]
            seconds[stage.name] += time.perf_counter() - started
        if self.embedder is not None and images:
            # Survivors are embedded here, while decoded, for the global dedup and balance passes;
            # the "_embedding" entry never reaches the manifest.
            started = time.perf_counter()
            for i, vector in zip(images, self.embedder(list(images.values()))):
                rows[i]["_embedding"] = vector
            seconds["embed"] += time.perf_counter() - started
        return rows

    def assess(self, path: str | Path) -> dict[str, Any]:
        """One manifest row for the file at ``path``."""
        return self.assess_batch([path])[0]
