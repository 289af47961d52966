"""Articulated body: forward kinematics from joint angles, then ellipsoids/capsules and keypoints.

Body frame (metres): x = the person's left, y = up, z = the direction the person faces; the
feet stand near y = 0. Bones hang along -y in their rest frame, so a limb's rotation maps
(0, -1, 0) to its direction and its frame columns orient hands, feet and the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sapiens2.data.synth import outfit as mats
from sapiens2.data.synth.labels import SEG_ID
from sapiens2.data.synth.outfit import Outfit
from sapiens2.data.synth.pose import BodyShape, Pose
from sapiens2.data.synth.primitives import Capsule, Ellipsoid, Region, Shape, band

_INF = np.inf
SIDES = (("left", "Left", 1.0), ("right", "Right", -1.0))


def rot_x(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])


def rot_y(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def rot_z(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


@dataclass(frozen=True)
class Skeleton:
    """Joint positions and segment frames in the body frame, plus segment sizes (metres)."""

    joints: dict[str, np.ndarray]
    frames: dict[str, np.ndarray]
    radii: dict[str, float]
    head_axes: np.ndarray


def pose_skeleton(shape: BodyShape, pose: Pose) -> Skeleton:
    """Forward kinematics: pelvis -> chest -> head and arms, pelvis -> legs (rest sizes for a
    1.75 m adult, scaled by height, girth and the shoulder/hip factors)."""
    s, w = shape.height / 1.75, np.sqrt(shape.girth)
    lean, bend, twist = pose.spine
    pelvis = rot_y(0.3 * twist)
    chest = pelvis @ rot_x(lean) @ rot_z(bend) @ rot_y(0.7 * twist)
    waist = np.array([0.0, 1.05 * s, 0.0])
    neck = waist + chest @ np.array([0.0, 0.40, -0.01]) * s
    head = chest @ rot_y(pose.head[0]) @ rot_x(pose.head[1]) @ rot_z(pose.head[2])
    joints = {"hip_centre": np.array([0.0, 0.90 * s, 0.0]), "waist": waist, "neck": neck,
              "head": neck + head @ np.array([0.0, 0.175, 0.02]) * s * shape.head}
    frames = {"pelvis": pelvis, "chest": chest, "head": head}
    radii = {"girdle": 0.055 * s * w, "upper_arm": 0.045 * s * w, "lower_arm": 0.036 * s * w,
             "upper_leg": 0.07 * s * w, "lower_leg": 0.05 * s * w, "neck": 0.05 * s * w}
    for i, (side, _, sign) in enumerate(SIDES):
        flex, abd, rot, elbow = pose.arms[i]
        upper = chest @ rot_z(sign * abd) @ rot_x(-flex) @ rot_y(-sign * rot)
        lower = upper @ rot_x(-elbow)
        shoulder = waist + chest @ np.array([sign * 0.175 * shape.shoulders, 0.385, 0.0]) * s
        elbow_pt = shoulder + upper @ np.array([0.0, -0.29, 0.0]) * s
        joints |= {f"{side}_shoulder": shoulder, f"{side}_elbow": elbow_pt,
                   f"{side}_wrist": elbow_pt + lower @ np.array([0.0, -0.255, 0.0]) * s}
        flex, abd, knee, toe = pose.legs[i]
        thigh = pelvis @ rot_z(sign * abd) @ rot_x(-flex) @ rot_y(sign * toe)
        shin = thigh @ rot_x(knee)
        hip = joints["hip_centre"] + pelvis @ np.array([sign * 0.09 * shape.hips, 0.0, 0.0]) * s
        knee_pt = hip + thigh @ np.array([0.0, -0.42, 0.0]) * s
        joints |= {f"{side}_hip": hip, f"{side}_knee": knee_pt,
                   f"{side}_ankle": knee_pt + shin @ np.array([0.0, -0.41, 0.0]) * s}
        # Feet follow the pelvis heading rather than the shin so standing feet stay flat.
        foot = pelvis @ rot_z(0.5 * sign * abd) @ rot_y(sign * toe) @ rot_x(-pose.feet[i])
        frames |= {f"{side}_upper_arm": upper, f"{side}_lower_arm": lower,
                   f"{side}_upper_leg": thigh, f"{side}_lower_leg": shin, f"{side}_foot": foot}
    head_axes = np.array([0.078, 0.112, 0.095]) * s * shape.head
    return Skeleton(joints, frames, radii, head_axes)


def _face_regions(outfit: Outfit) -> tuple[Region, ...]:
    """Eyes, lips and an optionally open mouth as boxes on the head's unit sphere."""
    face, eye = SEG_ID["Face_Neck"], mats.EYE
    regions = [Region(face, eye, (0.22, 0.06, 0.7), (0.42, 0.18, _INF)),
               Region(face, eye, (-0.42, 0.06, 0.7), (-0.22, 0.18, _INF))]
    lo = (-0.05 if outfit.mouth_open else 0.0)
    regions += [Region(SEG_ID["Upper_Lip"], mats.LIP, (-0.24, -0.48, 0.6), (0.24, -0.42, _INF)),
                Region(SEG_ID["Lower_Lip"], mats.LIP, (-0.22, -0.58 + lo, 0.6), (0.22, -0.5 + lo, _INF))]
    if outfit.mouth_open:
        regions += [Region(SEG_ID["Upper_Teeth"], mats.TEETH, (-0.16, -0.505, 0.6), (0.16, -0.48, _INF)),
                    Region(SEG_ID["Tongue"], mats.TONGUE, (-0.12, -0.53, 0.6), (0.12, -0.505, _INF)),
                    Region(SEG_ID["Lower_Teeth"], mats.TEETH, (-0.16, -0.55, 0.6), (0.16, -0.53, _INF))]
    return tuple(regions)


def _head_shapes(sk: Skeleton, outfit: Outfit) -> list[Shape]:
    head_c, frame, axes = sk.joints["head"], sk.frames["head"], sk.head_axes
    out: list[Shape] = [Ellipsoid("head", SEG_ID["Face_Neck"], mats.SKIN, head_c, frame,
                                  _face_regions(outfit), axes=axes)]
    top = head_c + frame @ np.array([0.0, -0.3 * axes[1], 0.0])
    out.append(Capsule("neck", SEG_ID["Face_Neck"], mats.SKIN,
                       sk.joints["neck"] - sk.frames["chest"] @ np.array([0.0, 0.04, 0.0]), frame,
                       end=top, radius=sk.radii["neck"]))
    hair = SEG_ID["Hair"]
    if outfit.hair != "bald":
        # The hair cap is open over the face: from the hairline down, in front of the ears.
        hairline = 0.3 if outfit.hair == "short" else 0.2
        out.append(Ellipsoid("hair", hair, mats.HAIR, head_c + frame @ np.array([0, 0.01, -0.01]),
                             frame, axes=axes * np.array([1.07, 1.06, 1.08]),
                             cutout=((-_INF, -_INF, -0.15), (_INF, hairline, _INF))))
    if outfit.hair == "long":
        nape = head_c + frame @ (np.array([0, -1.1, -0.5]) * axes)
        out.append(Ellipsoid("hair", hair, mats.HAIR, nape, frame, axes=axes * np.array([1.05, 1.3, 0.5])))
    if outfit.hat:
        crown = head_c + frame @ np.array([0, 0.012, 0])
        out.append(Ellipsoid("hat", SEG_ID["Apparel"], mats.APPAREL, crown, frame, axes=axes * 1.12,
                             cutout=((-_INF, -_INF, -_INF), (_INF, 0.3, _INF))))
        out.append(Ellipsoid("hat", SEG_ID["Apparel"], mats.APPAREL,
                             head_c + frame @ (np.array([0, 0.38, 0.45]) * axes), frame,
                             axes=axes * np.array([1.1, 0.08, 1.2])))
    if outfit.glasses:
        for sign in (1.0, -1.0):
            eye = np.array([0.32 * sign, 0.12, 0.94])
            centre = head_c + frame @ (eye / np.linalg.norm(eye) * axes + np.array([0, 0, 0.012]))
            out.append(Ellipsoid("glasses", SEG_ID["Eyeglass"], mats.GLASSES, centre, frame,
                                 axes=np.array([0.022, 0.016, 0.004]) * axes[1] / 0.112))
    return out


def _torso_shapes(sk: Skeleton, shape: BodyShape, outfit: Outfit) -> list[Shape]:
    s, w, g = shape.height / 1.75, np.sqrt(shape.girth), shape.girth
    chest_f, pelvis_f = sk.frames["chest"], sk.frames["pelvis"]
    torso, top_cls, low_cls = SEG_ID["Torso"], SEG_ID["Upper_Clothing"], SEG_ID["Lower_Clothing"]
    dressed = outfit.top != "none"
    chest_regions: list[Region] = []
    if dressed:
        chest_regions.append(Region(top_cls, mats.TOP, hi=(_INF, outfit.neckline, _INF)))
    if outfit.top == "crop":
        chest_regions.append(Region(torso, mats.SKIN, hi=(_INF, outfit.hem, _INF)))
    pelvis_regions = [Region(low_cls, mats.BOTTOM, hi=(_INF, outfit.waist, _INF))]
    if dressed and outfit.top != "crop":
        pelvis_regions.append(Region(top_cls, mats.TOP, lo=(-_INF, outfit.hem, -_INF)))
    abdomen_regions = [Region(low_cls, mats.BOTTOM, hi=(_INF, -0.45, _INF))]
    if dressed and outfit.top != "crop":
        abdomen_regions.append(Region(top_cls, mats.TOP))
    sleeves = outfit.top in ("tshirt", "long_sleeve")
    girdle_regions = [band(top_cls, mats.TOP, 0.0 if sleeves else 0.3, 1.0 if sleeves else 0.7)]
    out: list[Shape] = [
        Ellipsoid("chest", torso, mats.SKIN, sk.joints["waist"] + chest_f @ np.array([0, 0.26, 0]) * s,
                  chest_f, tuple(chest_regions),
                  axes=np.array([0.15 * shape.shoulders * w, 0.19, 0.10 * g]) * s),
        Ellipsoid("pelvis", torso, mats.SKIN,
                  sk.joints["hip_centre"] + pelvis_f @ np.array([0, 0.07, -0.005]) * s, pelvis_f,
                  tuple(pelvis_regions), axes=np.array([0.155 * shape.hips * w, 0.15, 0.10 * g]) * s),
        # The abdomen fills the waist between chest and pelvis so the torso does not pinch.
        Ellipsoid("abdomen", torso, mats.SKIN,
                  sk.joints["waist"] + chest_f @ np.array([0, 0.02, 0.005]) * s, chest_f, tuple(abdomen_regions),
                  axes=np.array([0.14 * (shape.shoulders + shape.hips) / 2 * w, 0.14, 0.095 * g]) * s),
        Capsule("girdle", torso, mats.SKIN, sk.joints["left_shoulder"], chest_f,
                tuple(girdle_regions) if dressed else (), end=sk.joints["right_shoulder"],
                radius=sk.radii["girdle"]),
    ]
    if outfit.bag == "backpack":
        out.append(Ellipsoid("bag", SEG_ID["Apparel"], mats.APPAREL,
                             sk.joints["waist"] + chest_f @ np.array([0, 0.25, -0.1 - 0.1 * g]) * s,
                             chest_f, axes=np.array([0.14, 0.2, 0.08]) * s))
    elif outfit.bag is not None:  # a shoulder bag hanging at the person's left or right hip
        x = (0.2 if outfit.bag == "left" else -0.2) * shape.hips
        out.append(Ellipsoid("bag", SEG_ID["Apparel"], mats.APPAREL,
                             sk.joints["hip_centre"] + pelvis_f @ np.array([x, 0, 0.02]) * s,
                             pelvis_f, axes=np.array([0.045, 0.13, 0.11]) * s))
    return out


def _limb_shapes(sk: Skeleton, shape: BodyShape, outfit: Outfit) -> list[Shape]:
    s = shape.height / 1.75
    top_cls, low_cls = SEG_ID["Upper_Clothing"], SEG_ID["Lower_Clothing"]
    out: list[Shape] = []
    for side, cap, _ in SIDES:
        j, f, r = sk.joints, sk.frames, sk.radii
        upper_arm = [band(top_cls, mats.TOP, 0, 1 if outfit.top == "long_sleeve" else outfit.sleeve)]
        lower_arm = [band(top_cls, mats.TOP, 0, outfit.sleeve)] if outfit.top == "long_sleeve" else []
        thigh = [band(low_cls, mats.BOTTOM, 0, 1 if outfit.bottom != "shorts" else outfit.leg_cover)]
        shin = []
        if outfit.sock_top is not None:
            shin.append(band(SEG_ID[f"{cap}_Sock"], mats.SOCK, outfit.sock_top, 1))
        if outfit.bottom != "shorts":
            shin.append(band(low_cls, mats.BOTTOM, 0, outfit.leg_cover))
        foot = [Region(SEG_ID[f"{cap}_Shoe"], mats.SHOE)] if outfit.shoes else []
        lower_f, foot_f = f[f"{side}_lower_arm"], f[f"{side}_foot"]
        out += [
            Capsule(f"{side}_upper_arm", SEG_ID[f"{cap}_Upper_Arm"], mats.SKIN, j[f"{side}_shoulder"],
                    f[f"{side}_upper_arm"], tuple(upper_arm) if outfit.sleeve > 0 else (),
                    end=j[f"{side}_elbow"], radius=r["upper_arm"]),
            Capsule(f"{side}_lower_arm", SEG_ID[f"{cap}_Lower_Arm"], mats.SKIN, j[f"{side}_elbow"],
                    lower_f, tuple(lower_arm), end=j[f"{side}_wrist"], radius=r["lower_arm"]),
            # Palm faces the thigh when the arm hangs: thin along x, long along the bone.
            Ellipsoid(f"{side}_hand", SEG_ID[f"{cap}_Hand"], mats.SKIN,
                      j[f"{side}_wrist"] + lower_f @ np.array([0, -0.075, 0]) * s, lower_f,
                      axes=np.array([0.02, 0.085, 0.042]) * s),
            Capsule(f"{side}_upper_leg", SEG_ID[f"{cap}_Upper_Leg"], mats.SKIN, j[f"{side}_hip"],
                    f[f"{side}_upper_leg"], tuple(thigh), end=j[f"{side}_knee"], radius=r["upper_leg"]),
            Capsule(f"{side}_lower_leg", SEG_ID[f"{cap}_Lower_Leg"], mats.SKIN, j[f"{side}_knee"],
                    f[f"{side}_lower_leg"], tuple(shin), end=j[f"{side}_ankle"], radius=r["lower_leg"]),
            Ellipsoid(f"{side}_foot", SEG_ID[f"{cap}_Foot"], mats.SKIN,
                      j[f"{side}_ankle"] + foot_f @ np.array([0, -0.035, 0.05]) * s, foot_f,
                      tuple(foot), axes=np.array([0.045, 0.035, 0.125]) * s),
        ]
    return out


def build_shapes(sk: Skeleton, shape: BodyShape, outfit: Outfit) -> list[Shape]:
    """All shapes of a dressed person in the body frame."""
    return _head_shapes(sk, outfit) + _torso_shapes(sk, shape, outfit) + _limb_shapes(sk, shape, outfit)


# Face keypoints as directions on the head's unit sphere (nose, eyes, ears).
_FACE_DIRS = np.array([[0, -0.15, 1], [0.33, 0.12, 0.93], [-0.33, 0.12, 0.93],
                       [0.98, 0.0, -0.1], [-0.98, 0.0, -0.1]])
_FACE_OWNERS = frozenset({"head", "hair", "hat", "glasses"})


@dataclass(frozen=True)
class Keypoints3D:
    """COCO keypoints in the body frame, with the shape names whose surface may show them and
    a depth tolerance: how far behind the first visible surface the point may lie.
    """

    points: np.ndarray  # (17, 3)
    owners: tuple[frozenset[str], ...]
    tolerance: np.ndarray  # (17,)


def keypoints_3d(sk: Skeleton, shape: BodyShape) -> Keypoints3D:
    """The 17 COCO keypoints: face points on the head surface, joints at joint centres."""
    dirs = _FACE_DIRS / np.linalg.norm(_FACE_DIRS, axis=1, keepdims=True)
    points = list(sk.joints["head"] + (dirs * sk.head_axes) @ sk.frames["head"].T)
    owners = [_FACE_OWNERS] * 5
    tol = [0.03, 0.03, 0.03, 0.05, 0.05]
    r = sk.radii
    # Joint centres sit inside limbs: allow the thickest part meeting at the joint, plus slack.
    pelvis_depth = 0.10 * shape.girth * shape.height / 1.75
    per_joint = (("shoulder", ("girdle", "chest", "{}_upper_arm"), 1.6 * r["girdle"]),
                 ("elbow", ("{}_upper_arm", "{}_lower_arm"), 1.6 * r["upper_arm"]),
                 ("wrist", ("{}_lower_arm", "{}_hand"), 1.6 * r["lower_arm"]),
                 ("hip", ("pelvis", "abdomen", "{}_upper_leg"), 1.3 * max(pelvis_depth, r["upper_leg"])),
                 ("knee", ("{}_upper_leg", "{}_lower_leg"), 1.6 * r["upper_leg"]),
                 ("ankle", ("{}_lower_leg", "{}_foot"), 1.6 * r["lower_leg"]))
    for joint, names, tolerance in per_joint:
        for side, _, _ in SIDES:
            points.append(sk.joints[f"{side}_{joint}"])
            owners.append(frozenset(n.format(side) for n in names))
            tol.append(tolerance)
    return Keypoints3D(np.asarray(points), tuple(owners), np.asarray(tol))
