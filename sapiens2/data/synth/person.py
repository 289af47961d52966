"""One synthetic person image with pixel-aligned labels for all five Sapiens2 tasks."""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from sapiens2.data.augment import mask_bbox
from sapiens2.data.synth.body import build_shapes, keypoints_3d, pose_skeleton
from sapiens2.data.synth.camera import sample_camera
from sapiens2.data.synth.outfit import Outfit, sample_outfit
from sapiens2.data.synth.pose import sample_pose, sample_shape
from sapiens2.data.synth.render import Hits, cast, lambert
from sapiens2.data.synth.textures import background
from sapiens2.data.synth.wholebody import keypoints308_3d

KEYPOINT_SETS = ("coco17", "sapiens308")


@dataclass(frozen=True)
class PersonSample:
    """A rendered person and its labels (camera-space geometry; background is zero/False).

    keypoints: (K, 3) x, y in pixels with pixel centres at column + 0.5, visibility 0 = outside
    the image, 1 = inside but occluded, 2 = visible; K = 17 (COCO) or 308 (whole body).
    bbox: x0, y0, x1, y1 of the foreground mask in the same continuous pixel coordinates.
    """

    image: np.ndarray  # (H, W, 3) uint8 RGB
    keypoints: np.ndarray  # (K, 3) float32
    seg: np.ndarray  # (H, W) uint8, SEG_CLASSES ids
    mask: np.ndarray  # (H, W) bool
    normal: np.ndarray  # (H, W, 3) float32 unit camera-space normals
    pointmap: np.ndarray  # (H, W, 3) float32 camera-space XYZ in metres
    albedo: np.ndarray  # (H, W, 3) uint8
    K: np.ndarray  # (3, 3) float32
    bbox: np.ndarray  # (4,) float32


def _visibility(pts_cam: np.ndarray, xy: np.ndarray, kp, hits: Hits, names: list[str]) -> np.ndarray:
    """2 where the first surface at the point's pixel belongs to the point's own body parts and
    lies within its tolerance in front of it, 1 if inside the image but hidden, 0 outside."""
    height, width = hits.index.shape
    inside = ((pts_cam[:, 2] > 0) & (xy[:, 0] >= 0) & (xy[:, 0] < width)
              & (xy[:, 1] >= 0) & (xy[:, 1] < height))
    vis = np.where(inside, 1.0, 0.0)
    for k in np.flatnonzero(inside):
        row, col = int(xy[k, 1]), int(xy[k, 0])
        idx = hits.index[row, col]
        if idx < 0 or (names[idx] in kp.owners[k]
                       and pts_cam[k, 2] - hits.depth[row, col] <= kp.tolerance[k]):
            vis[k] = 2.0
    return vis


def _light(rng: np.random.Generator) -> tuple[np.ndarray, float, np.ndarray]:
    """Directional light from above and mostly in front (camera space: -y up, -z towards us)."""
    light = np.array([rng.uniform(-0.8, 0.8), -rng.uniform(0.2, 1.0), -rng.uniform(0.2, 1.0)])
    colour = np.clip(1.0 + rng.normal(0, 0.05, 3), 0.8, 1.2) * rng.uniform(0.85, 1.15)
    return light / np.linalg.norm(light), float(rng.uniform(0.25, 0.5)), colour


def _albedo(outfit: Outfit, body_points: np.ndarray, material: np.ndarray) -> np.ndarray:
    out = np.empty((len(material), 3))
    for m in np.unique(material):
        sel = material == m
        out[sel] = outfit.materials[m].albedo(body_points[sel])
    return out


def _edges(index: np.ndarray) -> np.ndarray:
    """Pixels whose right or lower neighbour sees another shape (or the background)."""
    edge = np.zeros(index.shape, bool)
    dx, dy = index[:, 1:] != index[:, :-1], index[1:] != index[:-1]
    edge[:, 1:] |= dx
    edge[:, :-1] |= dx
    edge[1:] |= dy
    edge[:-1] |= dy
    return edge


def render_person(rng: np.random.Generator, height: int = 128, width: int = 96,
                  keypoint_set: str = "coco17") -> PersonSample:
    """Render a random dressed person in a random pose, camera, light and backdrop.

    keypoint_set "coco17" labels the 17 COCO keypoints, "sapiens308" the 308-keypoint whole-body
    set; the choice draws no random numbers, so both give the same image and dense labels.

    Labels sample each pixel centre; the RGB image is softened along silhouettes and part
    borders (mild anti-aliasing) so edges are not stair-stepped while labels stay exact.
    """
    if keypoint_set not in KEYPOINT_SETS:
        raise ValueError(f"unknown keypoint_set {keypoint_set!r}; expected one of {KEYPOINT_SETS}")
    shape, pose, outfit = sample_shape(rng), sample_pose(rng), sample_outfit(rng)
    skeleton = pose_skeleton(shape, pose)
    body_shapes = build_shapes(skeleton, shape, outfit)
    camera = sample_camera(rng, np.concatenate([s.extent_points() for s in body_shapes]), height, width)
    shapes = [s.moved(camera.rotation, -camera.rotation @ camera.position) for s in body_shapes]
    K = camera.K
    hits = cast(shapes, K, height, width)
    mask = hits.mask

    fg_albedo = _albedo(outfit, camera.to_body(hits.points[mask]), hits.material[mask])
    albedo = np.zeros((height, width, 3))
    albedo[mask] = fg_albedo
    image = background(rng, height, width).astype(np.float64) * rng.uniform(0.7, 1.05)
    image[mask] = lambert(fg_albedo, hits.normal[mask], *_light(rng))
    edge = _edges(hits.index)
    image[edge] = cv2.GaussianBlur(image, (3, 3), 0.6)[edge]
    image += rng.normal(0, rng.uniform(0, 0.02), image.shape)

    if keypoint_set == "sapiens308":
        kp = keypoints308_3d(skeleton, shape, body_shapes)
    else:
        kp = keypoints_3d(skeleton, shape)
    pts_cam = camera.to_camera(kp.points)
    xy = (pts_cam[:, :2] / pts_cam[:, 2:]) * np.diag(K)[:2] + K[:2, 2]
    vis = _visibility(pts_cam, xy, kp, hits, [s.name for s in shapes])
    return PersonSample(
        image=np.round(np.clip(image, 0, 1) * 255).astype(np.uint8),
        keypoints=np.concatenate([xy, vis[:, None]], axis=1).astype(np.float32),
        seg=hits.seg,
        mask=mask,
        normal=hits.normal.astype(np.float32),
        pointmap=hits.points.astype(np.float32),
        albedo=np.round(albedo * 255).astype(np.uint8),
        K=K.astype(np.float32),
        bbox=mask_bbox(mask),
    )
