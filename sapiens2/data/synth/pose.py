"""Random body proportions and joint angles within human limits, mostly upright poses."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_DEG = np.pi / 180.0
POSE_FAMILIES = ("standing", "walking", "arms_raised", "varied")
_FAMILY_PROBS = (0.4, 0.3, 0.15, 0.15)


@dataclass(frozen=True)
class BodyShape:
    """Person proportions: height in metres and relative width/thickness factors around 1."""

    height: float
    shoulders: float
    hips: float
    girth: float
    head: float


@dataclass(frozen=True)
class Pose:
    """Joint angles in radians. Rows of `arms`/`legs` are (left, right) from the person's view.

    arms columns: flexion (forward raise), abduction (sideways raise), internal rotation, elbow.
    legs columns: flexion (forward), abduction (outward), knee bend, toe-out; `feet` is the
    ankle pitch per leg (positive lifts the toes).
    """

    family: str
    spine: tuple[float, float, float]  # forward lean, side bend, twist
    head: tuple[float, float, float]  # yaw, pitch (down), roll
    arms: np.ndarray
    legs: np.ndarray
    feet: np.ndarray


def sample_shape(rng: np.random.Generator) -> BodyShape:
    feminine = rng.random() < 0.5
    return BodyShape(
        height=float(rng.normal(1.64 if feminine else 1.76, 0.07)),
        shoulders=float(rng.uniform(0.85, 0.97) if feminine else rng.uniform(0.97, 1.1)),
        hips=float(rng.uniform(1.0, 1.12) if feminine else rng.uniform(0.92, 1.02)),
        girth=float(rng.uniform(0.85, 1.25)),
        head=float(rng.uniform(0.95, 1.05)),
    )


def _u(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi)) * _DEG


def _arm(rng, flex=(-10, 15), abd=(6, 20), rot=(-10, 20), elbow=(0, 30)) -> list[float]:
    return [_u(rng, *flex), _u(rng, *abd), _u(rng, *rot), _u(rng, *elbow)]


def _leg(rng, flex=(-5, 8), abd=(0, 8), knee=(0, 10), toe=(0, 20)) -> list[float]:
    return [_u(rng, *flex), _u(rng, *abd), _u(rng, *knee), _u(rng, *toe)]


def sample_pose(rng: np.random.Generator) -> Pose:
    """Draw a pose family, then joint angles for it."""
    family = POSE_FAMILIES[rng.choice(len(POSE_FAMILIES), p=_FAMILY_PROBS)]
    spine = (_u(rng, -5, 10), _u(rng, -6, 6), _u(rng, -12, 12))
    head = (_u(rng, -35, 35), _u(rng, -15, 20), _u(rng, -8, 8))
    arms = [_arm(rng), _arm(rng)]
    legs = [_leg(rng), _leg(rng)]
    feet = [_u(rng, -5, 5), _u(rng, -5, 5)]
    if family == "walking":
        swing = _u(rng, 12, 30)
        front = int(rng.integers(2))
        back = 1 - front
        legs[front] = _leg(rng, flex=(0, 0), abd=(0, 5), knee=(0, 15))
        legs[front][0] = swing
        legs[back] = _leg(rng, flex=(0, 0), abd=(0, 5), knee=(15, 45))
        legs[back][0] = -swing * 0.8
        feet[front] = _u(rng, 5, 20)
        feet[back] = _u(rng, -30, -10)
        # Arms swing against the legs.
        arms[front][0] = -swing * float(rng.uniform(0.5, 1.2))
        arms[back][0] = swing * float(rng.uniform(0.5, 1.2))
        arms[front][3], arms[back][3] = _u(rng, 5, 40), _u(rng, 10, 50)
    elif family == "arms_raised":
        for side in range(2) if rng.random() < 0.6 else [int(rng.integers(2))]:
            arms[side] = _arm(rng, flex=(-20, 40), abd=(70, 165), rot=(-30, 30), elbow=(0, 70))
    elif family == "varied":
        kind = rng.integers(4)
        if kind == 0:  # hands on hips
            for side in range(2):
                arms[side] = _arm(rng, flex=(-10, 10), abd=(35, 55), rot=(50, 80), elbow=(80, 110))
        elif kind == 1:  # one leg lifted or stepping out
            side = int(rng.integers(2))
            legs[side] = _leg(rng, flex=(20, 75), abd=(0, 25), knee=(10, 90))
            arms[1 - side] = _arm(rng, flex=(-20, 60), abd=(10, 80), elbow=(0, 60))
        elif kind == 2:  # bending forward, arms reaching
            spine = (_u(rng, 20, 45), spine[1], spine[2])
            for side in range(2):
                arms[side] = _arm(rng, flex=(30, 80), abd=(5, 20), elbow=(0, 40))
            legs = [_leg(rng, knee=(0, 25)), _leg(rng, knee=(0, 25))]
        else:  # wide stance, arms out
            for side in range(2):
                legs[side] = _leg(rng, abd=(12, 25), knee=(0, 20))
                arms[side] = _arm(rng, flex=(-20, 20), abd=(40, 100), elbow=(0, 45))
    return Pose(family, spine, head, np.asarray(arms), np.asarray(legs), np.asarray(feet))
