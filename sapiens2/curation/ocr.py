"""The ``text_ocr`` stage: PP-OCRv4's learned text detector measures how much of an image is text.

A learned alternative to the classical MSER ``text_overlay`` stage (run one or the other). Only
the detection network of RapidOCR (``rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx``,
a DB segmenter) is used: where text is matters here, not what it says. RapidOCR's own classes
import pyclipper and shapely, which are not installed, so its pre- and post-processing are
re-implemented: BGR input scaled to [-1, 1], sides multiples of 32; the probability map is
binarised, dilated 2x2, each contour's min-area rectangle kept when its mean probability passes
``box_threshold`` and grown by ``area * unclip_ratio / perimeter`` on every side (what
pyclipper's round offset then ``minAreaRect`` give for a rectangle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from sapiens2.curation.config import CurationConfig, OcrConfig
from sapiens2.curation.packaged import onnx_session, package_file
from sapiens2.curation.registry import Stage, register

MODEL = "models/ch_PP-OCRv4_det_infer.onnx"
_MAX_CANDIDATES = 1000  # RapidOCR's cap on contours per image
_MIN_SIDE = 3  # px on the probability map; thinner boxes are noise (RapidOCR's min_size)


def model_size(height: int, width: int, long_side: int, max_upscale: float) -> tuple[int, int]:
    """(height, width) the detector sees: long side ``long_side`` (small images enlarged at most
    ``max_upscale`` times), both sides multiples of 32."""
    ratio = min(long_side / max(height, width), max_upscale)
    return max(32, round(height * ratio / 32) * 32), max(32, round(width * ratio / 32) * 32)


def text_mask(prob: np.ndarray, config: OcrConfig) -> tuple[np.ndarray, int]:
    """DB post-processing of one probability map: the mask covered by text boxes, and their count."""
    bitmap = cv2.dilate((prob > config.binary_threshold).astype(np.uint8), np.ones((2, 2), np.uint8))
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    mask = np.zeros(prob.shape, np.uint8)
    boxes = 0
    for contour in contours[:_MAX_CANDIDATES]:
        (cx, cy), (w, h), angle = cv2.minAreaRect(contour)
        corners = cv2.boxPoints(((cx, cy), (w, h), angle))
        if min(w, h) < _MIN_SIDE or not _horizontal_line(corners, config.min_box_aspect):
            continue
        x0, y0 = np.clip(np.floor(corners.min(axis=0)).astype(int), 0, None)
        x1, y1 = np.minimum(np.ceil(corners.max(axis=0)).astype(int), (prob.shape[1] - 1, prob.shape[0] - 1))
        inside = np.zeros((y1 - y0 + 1, x1 - x0 + 1), np.uint8)
        cv2.fillPoly(inside, [np.round(corners - (x0, y0)).astype(np.int32)], 1)
        if cv2.mean(prob[y0:y1 + 1, x0:x1 + 1], inside)[0] < config.box_threshold:
            continue
        grow = w * h * config.unclip_ratio / (2 * (w + h))
        if min(w, h) + 2 * grow < _MIN_SIDE + 2:
            continue
        grown = cv2.boxPoints(((cx, cy), (w + 2 * grow, h + 2 * grow), angle))
        cv2.fillPoly(mask, [np.round(grown).astype(np.int32)], 1)
        boxes += 1
    return mask, boxes


def _horizontal_line(corners: np.ndarray, min_aspect: float) -> bool:
    """A box whose long side lies within 45 degrees of horizontal and is ``min_aspect`` times its
    short side. Overlay text runs in horizontal lines; on small images upscaled for the
    detector, an upright person or pole looks like one tall glyph, and blobs fire too."""
    edges = corners[1:3] - corners[:2]
    lengths = np.hypot(edges[:, 0], edges[:, 1])
    long, short = (0, 1) if lengths[0] >= lengths[1] else (1, 0)
    return abs(edges[long, 0]) >= abs(edges[long, 1]) and lengths[long] >= min_aspect * lengths[short]


@register
class TextOcrStage(Stage):
    name, reason, columns = "text_ocr", "text_overlay", ("ocr_text_area", "ocr_boxes")

    def __init__(self, config: CurationConfig) -> None:
        self.config = config.ocr
        self.session = onnx_session(package_file("rapidocr_onnxruntime", MODEL))
        self.input_name = self.session.get_inputs()[0].name
        # Every image is resized to long_side; its short side never needs more.
        self.input_side = self.config.long_side

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        area, count = [0.0] * len(images), [0] * len(images)
        # One forward pass per distinct model input size (a web batch of one size is one pass).
        groups: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(images):
            size = model_size(*image.shape[:2], self.config.long_side, self.config.max_upscale)
            groups.setdefault(size, []).append(i)
        for (height, width), members in groups.items():
            batch = np.stack([_normalise(cv2.resize(images[i], (width, height), interpolation=cv2.INTER_LINEAR))
                              for i in members])
            probs = self.session.run(None, {self.input_name: batch})[0][:, 0]
            for i, prob in zip(members, probs):
                mask, count[i] = text_mask(prob, self.config)
                area[i] = float(mask.mean())
        return {"ocr_text_area": area, "ocr_boxes": count}

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        if scores["ocr_text_area"] > self.config.max_text_area:
            return (f"OCR text boxes cover {scores['ocr_text_area']:.3f} of the image > {self.config.max_text_area} "
                    f"({scores['ocr_boxes']} boxes)")
        return None


def _normalise(rgb: np.ndarray) -> np.ndarray:
    """(3, H, W) float32: BGR, as RapidOCR feeds the network, scaled (x / 255 - 0.5) / 0.5."""
    return (rgb[..., ::-1].transpose(2, 0, 1).astype(np.float32) / 127.5) - 1.0
