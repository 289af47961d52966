"""The ``safety`` stage: NudeNet's packaged ONNX detector scores exposed nudity.

NudeNet 3.4 (``nudenet/320n.onnx``) is a YOLOv8-n detector of 18 body-part classes. Its own
``NudeDetector`` opens a session on every core and expects BGR input, so this stage runs the
same file with the package's pre-processing: pad right and bottom to a square with black,
resize to the model input (bilinear), scale to [0, 1], RGB, NCHW. The score is the highest class
probability any anchor gives an unsafe class, so no box threshold or NMS is involved (NMS never
changes the maximum) and the score stays continuous for histograms and threshold tuning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_args

import cv2
import numpy as np

from sapiens2.curation.config import CurationConfig, NudeNetClass
from sapiens2.curation.packaged import onnx_session, package_file
from sapiens2.curation.registry import Stage, register

LABELS: tuple[str, ...] = get_args(NudeNetClass)


def nudenet_input(image: np.ndarray, size: int) -> np.ndarray:
    """(3, size, size) float32 in [0, 1]: ``image`` padded right/bottom to a square, then resized."""
    height, width = image.shape[:2]
    side = max(height, width)
    square = cv2.copyMakeBorder(image, 0, side - height, 0, side - width, cv2.BORDER_CONSTANT, value=0)
    resized = cv2.resize(square, (size, size), interpolation=cv2.INTER_LINEAR)
    return resized.transpose(2, 0, 1).astype(np.float32) / 255.0


@register
class SafetyStage(Stage):
    # Score columns are numeric in the manifest (pipelines.curate stores them as float), so the
    # winning class is not a column; ``nsfw_class`` names it for inspection.
    name, reason, columns = "safety", "unsafe", ("nsfw_score",)

    def __init__(self, config: CurationConfig) -> None:
        self.config = config.safety
        self.session = onnx_session(package_file("nudenet", "320n.onnx"))
        self.input_name = self.session.get_inputs()[0].name
        self.unsafe = np.array([LABELS.index(name) for name in self.config.unsafe_classes])
        # The padded square's long side becomes input_size: no short side needs more.
        self.input_side = self.config.input_size

    def class_scores(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """(N, len(unsafe_classes)): each unsafe class's highest probability over the anchors."""
        if not images:
            return np.zeros((0, len(self.unsafe)), np.float32)
        batch = np.stack([nudenet_input(image, self.config.input_size) for image in images])
        # output0: (N, 4 + 18, anchors): box centre/size, then one sigmoid probability per class.
        probs = self.session.run(None, {self.input_name: batch})[0][:, 4:, :]
        return probs[:, self.unsafe, :].max(axis=2)

    def nsfw_class(self, images: Sequence[np.ndarray]) -> list[str]:
        """The unsafe class behind each image's ``nsfw_score``."""
        return [self.config.unsafe_classes[k] for k in self.class_scores(images).argmax(axis=1)]

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        return {"nsfw_score": [float(v) for v in self.class_scores(images).max(axis=1)]}

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        if scores["nsfw_score"] > self.config.max_nsfw_score:
            return f"unsafe-class score {scores['nsfw_score']:.3f} > {self.config.max_nsfw_score}"
        return None
