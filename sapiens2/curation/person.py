"""Person detection with detectors that ship inside OpenCV (no weights to download).

Three classical detectors, and any confident, prominent detection counts as a person:
the Dalal-Triggs HOG + linear SVM pedestrian model (the main, scored detector), the
Viola-Jones full-body cascade (few false alarms on textured backgrounds, catches some bodies
HOG misses) and the frontal-face cascade for portraits and crops where the legs are out of
frame, which both body detectors miss.
"""

from __future__ import annotations

import cv2
import numpy as np

from sapiens2.curation.config import PersonDetectorConfig

# Boxes (N, 4) as x0, y0, x1, y1 in pixels of the original image.
_EMPTY = np.zeros((0, 4))


def _boxes(rects: np.ndarray, offset: float, factor: float) -> np.ndarray:
    """(x, y, w, h) rects found on a resized, padded copy -> x0, y0, x1, y1 on the original."""
    rects = np.asarray(rects, dtype=np.float64).reshape(-1, 4)
    boxes = np.concatenate([rects[:, :2], rects[:, :2] + rects[:, 2:]], axis=1)
    return (boxes - offset) / factor


def _clip(boxes: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.stack([boxes[:, 0].clip(0, width), boxes[:, 1].clip(0, height),
                     boxes[:, 2].clip(0, width), boxes[:, 3].clip(0, height)], 1)


def _area_fraction(boxes: np.ndarray, height: int, width: int) -> np.ndarray:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / float(height * width)


def _nms(boxes: np.ndarray, max_overlap: float) -> np.ndarray:
    """Greedy suppression in the given priority order; returns kept indices."""
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep: list[int] = []
    for i in range(len(boxes)):
        ix = np.clip(np.minimum(boxes[i, 2], boxes[keep, 2]) - np.maximum(boxes[i, 0], boxes[keep, 0]), 0, None)
        iy = np.clip(np.minimum(boxes[i, 3], boxes[keep, 3]) - np.maximum(boxes[i, 1], boxes[keep, 1]), 0, None)
        # Intersection over the smaller box: a face inside a body box is the same person.
        overlap = ix * iy / (np.minimum(area[i], area[keep]) + 1e-9)
        if not np.any(overlap > max_overlap):
            keep.append(i)
    return np.asarray(keep, dtype=np.int64)


class PersonDetector:
    """Scores ``num_persons``, ``person_score`` (best HOG SVM margin, floored at 0 so that "no
    evidence" reads 0) and ``person_area`` (largest counted box / image area).

    ``num_persons`` counts prominent HOG bodies, or, when there are none, the detections of the
    first fallback cascade that finds any.

    Not picklable (it holds OpenCV detectors): build one per worker process.
    """

    def __init__(self, config: PersonDetectorConfig) -> None:
        self.config = config
        self._hog = cv2.HOGDescriptor()
        self._hog.setSVMDetector(cv2.HOGDescriptor_getDefaultPeopleDetector())
        folder = cv2.data.haarcascades
        body, face = "haarcascade_fullbody.xml", "haarcascade_frontalface_default.xml"
        self._body = cv2.CascadeClassifier(folder + body) if config.use_body_cascade else None
        self._face = cv2.CascadeClassifier(folder + face) if config.use_face_cascade else None

    def _prepare(self, image: np.ndarray) -> tuple[np.ndarray, int, float]:
        """Resize to ``target_height`` and pad: detectors scan only downscaled pyramid levels, and
        the border lets a frame-filling body fit a window with the context margin it was trained on."""
        cfg = self.config
        height, width = image.shape[:2]
        factor = cfg.target_height / height
        interp = cv2.INTER_AREA if factor < 1 else cv2.INTER_LINEAR
        resized = cv2.resize(image, (max(1, round(width * factor)), cfg.target_height), interpolation=interp)
        pad = round(cfg.pad_fraction * cfg.target_height)
        return cv2.copyMakeBorder(resized, pad, pad, pad, pad, cv2.BORDER_REPLICATE), pad, factor

    def _detect_hog(self, padded: np.ndarray, pad: int, factor: float) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        rects, weights = self._hog.detectMultiScale(
            padded, hitThreshold=cfg.hit_threshold, winStride=(cfg.win_stride,) * 2, padding=(0, 0), scale=cfg.scale
        )
        if len(rects) == 0:
            return _EMPTY, np.zeros(0)
        return _boxes(rects, pad, factor), np.ravel(weights).astype(np.float64)

    @staticmethod
    def _detect_cascade(cascade: cv2.CascadeClassifier, grey: np.ndarray, min_neighbors: int,
                        min_side: int) -> np.ndarray:
        rects = cascade.detectMultiScale(grey, scaleFactor=1.1, minNeighbors=min_neighbors,
                                         minSize=(min_side, min_side))
        return np.asarray(rects, dtype=np.float64).reshape(-1, 4)

    def _prominent_bodies(self, boxes: np.ndarray, height: int, width: int) -> np.ndarray:
        boxes = _clip(boxes, height, width)
        return boxes[_area_fraction(boxes, height, width) >= self.config.min_area_fraction]

    def __call__(self, image: np.ndarray) -> dict[str, float]:
        cfg = self.config
        height, width = image.shape[:2]
        padded, pad, factor = self._prepare(image)
        hog_boxes, margins = self._detect_hog(padded, pad, factor)
        strongest_first = np.argsort(-margins, kind="stable")
        confident = strongest_first[margins[strongest_first] >= cfg.min_score]
        boxes = self._prominent_bodies(hog_boxes[confident], height, width)
        # The cascades are slower than HOG, so they only run as fallbacks when HOG found nobody.
        grey = cv2.cvtColor(padded, cv2.COLOR_RGB2GRAY) if len(boxes) == 0 else None
        if grey is not None and self._body is not None:
            rects = self._detect_cascade(self._body, grey, cfg.body_min_neighbors, min_side=16)
            boxes = self._prominent_bodies(_boxes(rects, pad, factor), height, width)
        if len(boxes) == 0 and grey is not None and self._face is not None:
            # A face this large (minSize) already means a person in the foreground.
            min_side = max(12, round(cfg.min_face_fraction * factor * min(height, width)))
            rects = self._detect_cascade(self._face, cv2.equalizeHist(grey), cfg.face_min_neighbors, min_side)
            boxes = _clip(_boxes(rects, pad, factor), height, width)
        boxes = boxes[_nms(boxes, max_overlap=0.5)]
        areas = _area_fraction(boxes, height, width)
        return {
            "num_persons": float(len(boxes)),
            "person_score": max(0.0, float(margins.max())) if len(margins) else 0.0,
            "person_area": float(areas.max()) if len(areas) else 0.0,
        }
