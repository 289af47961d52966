"""Per-person appearance: clothing cut, hair style, accessories and the material palette."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sapiens2.data.synth import textures
from sapiens2.data.synth.textures import Material

# Material ids index Outfit.materials.
SKIN, HAIR, TOP, BOTTOM, SHOE, SOCK, APPAREL, LIP, EYE, TEETH, TONGUE, GLASSES = range(12)

TOPS = ("tshirt", "long_sleeve", "tank", "crop", "none")
_TOP_PROBS = (0.42, 0.26, 0.14, 0.08, 0.10)
BOTTOMS = ("trousers", "shorts", "capri")
_BOTTOM_PROBS = (0.55, 0.3, 0.15)


@dataclass(frozen=True)
class Outfit:
    """What a person wears. Fractions refer to the capsule axis (0 at the proximal joint) and
    heights to the local unit-sphere y of the chest or pelvis ellipsoid.
    """

    top: str
    sleeve: float  # tshirt: covered share of the upper arm; long sleeve: of the forearm
    neckline: float  # chest y above which skin shows
    hem: float  # pelvis y above which an untucked top covers; for a crop top, chest y
    bottom: str
    leg_cover: float  # shorts: covered share of the thigh; trousers/capri: of the shin
    waist: float  # pelvis y below which the bottoms cover
    shoes: bool
    sock_top: float | None  # shin share where visible socks start
    hair: str  # bald, short or long
    hat: bool
    glasses: bool
    bag: str | None  # backpack, left or right (shoulder bag at that hip)
    mouth_open: bool
    materials: tuple[Material, ...]


def sample_outfit(rng: np.random.Generator) -> Outfit:
    top = TOPS[rng.choice(len(TOPS), p=_TOP_PROBS)]
    bottom = BOTTOMS[rng.choice(len(BOTTOMS), p=_BOTTOM_PROBS)]
    sleeve = {"tshirt": rng.uniform(0.3, 0.85), "long_sleeve": rng.uniform(0.8, 1.0)}.get(top, 0.0)
    leg_cover = {"shorts": rng.uniform(0.3, 0.85), "trousers": rng.uniform(0.9, 1.0),
                 "capri": rng.uniform(0.3, 0.7)}[bottom]
    shoes = rng.random() < 0.85
    socks_show = shoes and bottom != "trousers" and rng.random() < 0.6
    sock_top = float(rng.uniform(0.7, 0.92)) if socks_show else None
    waist = float(rng.uniform(0.35, 0.75))
    lips = np.clip(rng.uniform(0.45, 0.7) * np.array([1.0, 0.45, 0.45]), 0, 1)
    materials = (
        textures.skin(rng), textures.hair(rng), textures.fabric(rng), textures.fabric(rng, 0.7),
        textures.fabric(rng, 0.8), textures.fabric(rng, 0.7), textures.fabric(rng, 0.6),
        textures.flat(lips), textures.flat([0.08, 0.06, 0.05]), textures.flat([0.9, 0.88, 0.8]),
        textures.flat([0.7, 0.3, 0.3]), textures.flat(rng.uniform(0.02, 0.2, 3)),
    )
    return Outfit(
        top=top,
        sleeve=float(sleeve),
        neckline=float(rng.uniform(0.55, 0.9)),
        # An untucked top reaches below the waistband so no skin shows between the two.
        hem=float(rng.uniform(-0.6, -0.1) if top == "crop" else rng.uniform(-0.2, waist - 0.05)),
        bottom=bottom,
        leg_cover=float(leg_cover),
        waist=waist,
        shoes=bool(shoes),
        sock_top=sock_top,
        hair=str(rng.choice(("bald", "short", "long"), p=(0.1, 0.58, 0.32))),
        hat=bool(rng.random() < 0.12),
        glasses=bool(rng.random() < 0.15),
        bag=str(rng.choice(("backpack", "left", "right"))) if rng.random() < 0.15 else None,
        mouth_open=bool(rng.random() < 0.2),
        materials=materials,
    )
