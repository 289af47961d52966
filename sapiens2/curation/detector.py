"""``onnx_person``: a learned person detector, any architecture, exported to ONNX.

The HOG stage (``person``) misses small and partly hidden people and takes cats for people; a
trained detector (YOLO, RT-DETR, ...) fixes both, and ONNX keeps the stage free of each
detector's training code. The file comes from ``curation.onnx_person.model`` (a local path
or ``s3://``, fetched into a local cache by the curate step before curation); nothing downloads at run time.

Model contract (what an exporter must produce):

* input 0: float32 (N, 3, S, S), RGB in [0, 1], S = ``input_size``. Each image is letterboxed:
  scaled by S / max(h, w) (aspect kept) into the top-left corner, the rest grey (114/255).
  A static batch dim (e.g. 1) is honoured by running the batch in chunks of that size.
* output 0: float32 (N, K, 6), rows ``[x1, y1, x2, y2, score, class]`` in input pixels,
  after NMS; rows that hold no detection have score 0 (or below ``min_score``). (K, 6) is
  accepted when N == 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from sapiens2.curation.config import CurationConfig, OnnxDetectorConfig
from sapiens2.curation.model_store import resolve_model
from sapiens2.curation.packaged import onnx_session
from sapiens2.curation.registry import Stage, register

PAD = 114 / 255  # the letterbox grey of YOLO exports


def letterbox(image: np.ndarray, side: int) -> tuple[np.ndarray, float, float]:
    """(side x side x 3 float32 in [0, 1] with ``image`` top-left, x scale, y scale)."""
    h, w = image.shape[:2]
    scale = side / max(h, w)
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
    canvas = np.full((side, side, 3), PAD, np.float32)
    canvas[:new_h, :new_w] = cv2.resize(image, (new_w, new_h), interpolation=interp).astype(np.float32) / 255.0
    return canvas, new_w / w, new_h / h


class OnnxPersonDetector:
    """Person boxes in image pixels for a batch of RGB uint8 images; one ORT session, 1 thread
    (curation parallelises across worker processes)."""

    def __init__(self, config: OnnxDetectorConfig, path: Path) -> None:
        try:
            self.session = onnx_session(path)
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            raise ValueError(f"curation.onnx_person.model: {path} is not a loadable ONNX model: {exc}") from exc
        self.path, self.config = path, config
        meta = self.session.get_inputs()[0]
        self.input_name = meta.name
        shape = list(meta.shape)
        side = config.input_size
        # Dynamic dims are names (str) or None; only fixed ones are checked.
        expected = (None, 3, side, side)
        if len(shape) != 4 or any(isinstance(d, int) and e is not None and d != e for d, e in zip(shape, expected)):
            raise ValueError(f"{path}: input {meta.name!r} has shape {shape}; expected (N, 3, {side}, {side}) "
                             f"for curation.onnx_person.input_size={side}")
        self.fixed_batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else None

    def __call__(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per image, (K, 6) ``[x1, y1, x2, y2, score, class]`` in image pixels (all rows)."""
        if not images:
            return []
        boxed = [letterbox(image, self.config.input_size) for image in images]
        batch = np.ascontiguousarray(np.stack([b[0] for b in boxed]).transpose(0, 3, 1, 2))
        step = self.fixed_batch or len(images)
        outputs = []
        for start in range(0, len(images), step):
            chunk = batch[start:start + step]
            out = np.asarray(self.session.run(None, {self.input_name: chunk})[0], dtype=np.float32)
            if out.ndim == 2 and len(chunk) == 1:
                out = out[None]
            if out.ndim != 3 or out.shape[0] != len(chunk) or out.shape[2] < 6:
                raise ValueError(f"{self.path}: output 0 has shape {out.shape}; expected ({len(chunk)}, K, 6) "
                                 "rows [x1, y1, x2, y2, score, class]")
            outputs.extend(out)
        result = []
        for image, (_, sx, sy), rows in zip(images, boxed, outputs):
            h, w = image.shape[:2]
            rows = rows[:, :6].copy()
            rows[:, [0, 2]] = np.clip(rows[:, [0, 2]] / sx, 0, w)
            rows[:, [1, 3]] = np.clip(rows[:, [1, 3]] / sy, 0, h)
            result.append(rows)
        return result


@register
class OnnxPersonStage(Stage):
    """At least one prominent person: a ``person_class`` box scoring ``min_score`` that covers
    ``min_area_fraction`` of the image."""

    name, reason, columns = "onnx_person", "no_person", ("det_persons", "det_person_area", "det_score")

    def __init__(self, config: CurationConfig) -> None:
        cfg = config.onnx_person
        if cfg.model is None:
            raise ValueError(f"curation.onnx_person.model is required by stage {self.name!r}")
        self.config = cfg
        self.detector = OnnxPersonDetector(cfg, resolve_model(cfg.model, field="curation.onnx_person.model"))
        # Letterboxing maps the long side to input_size, so the short side never needs more.
        self.input_side = cfg.input_size

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        cfg, columns = self.config, {c: [] for c in self.columns}
        for image, rows in zip(images, self.detector(images)):
            rows = rows[rows[:, 5].round() == cfg.person_class]
            area = np.clip(rows[:, 2] - rows[:, 0], 0, None) * np.clip(rows[:, 3] - rows[:, 1], 0, None)
            fraction = area / float(image.shape[0] * image.shape[1])
            confident = rows[:, 4] >= cfg.min_score
            columns["det_persons"].append(int((confident & (fraction >= cfg.min_area_fraction)).sum()))
            columns["det_person_area"].append(float(fraction[confident].max(initial=0.0)))
            columns["det_score"].append(float(rows[:, 4].max(initial=0.0)))
        return columns

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        if scores["det_persons"] < 1:
            return (f"no person box with score >= {self.config.min_score} covering >= "
                    f"{self.config.min_area_fraction} (best score {scores['det_score']:.2f}, "
                    f"largest confident box {scores['det_person_area']:.3f})")
        return None
