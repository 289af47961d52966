"""A synthetic "web pool": person images plus labelled distractors, written by a worker pool.

Every file is a pure function of (seed, item index), so the bytes do not depend on the number
of workers or the order in which they finish.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from tqdm import tqdm

from sapiens2.data.synth import distractors as junk
from sapiens2.data.synth.person import PersonSample, render_person
from sapiens2.data.synth.sample_io import encode_image, write_sample

KINDS = ("person", "no_person", "duplicate", "near_duplicate", "text_overlay", "too_small",
         "blurred", "corrupt")
# What a correct curation step should decide for each kind: (status, reason).
EXPECTED: dict[str, tuple[str, str | None]] = {
    "person": ("kept", None),
    "no_person": ("rejected", "no_person"),
    "duplicate": ("rejected", "duplicate"),
    "near_duplicate": ("rejected", "duplicate"),
    "text_overlay": ("rejected", "text_overlay"),
    "too_small": ("rejected", "too_small"),
    "blurred": ("rejected", "low_quality"),
    "corrupt": ("quarantined", "unreadable"),
}
_DERIVED = ("duplicate", "near_duplicate")  # copies of a pool person; ids after all originals


@dataclass(frozen=True)
class DistractorMix:
    """Share of the whole pool taken by each distractor kind; people fill the rest."""

    no_person: float = 0.06
    duplicate: float = 0.05
    near_duplicate: float = 0.05
    text_overlay: float = 0.04
    too_small: float = 0.04
    blurred: float = 0.03
    corrupt: float = 0.03

    def __post_init__(self) -> None:
        shares = asdict(self)
        if any(v < 0 for v in shares.values()) or sum(shares.values()) >= 1:
            raise ValueError(f"distractor shares must be >= 0 and sum below 1, got {shares}")

    def counts(self, n_people: int) -> dict[str, int]:
        """Images per kind for a pool holding `n_people` clean person images."""
        shares = asdict(self)
        total = n_people / (1.0 - sum(shares.values()))
        counts = {"person": n_people} | {k: int(round(v * total)) for k, v in shares.items()}
        for kind in _DERIVED:  # copies need originals to copy
            if n_people == 0:
                counts[kind] = 0
        return counts


@dataclass(frozen=True)
class PoolItem:
    index: int  # position in the plan; seeds this item's random streams
    id: str
    kind: str
    source: int | None  # plan index of the person a duplicate copies


def plan_pool(n_people: int, seed: int, mix: DistractorMix) -> list[PoolItem]:
    """Ids and kinds: originals in shuffled kind order, then duplicates of random people."""
    counts = mix.counts(n_people)
    rng = np.random.default_rng([seed, 2**31])
    originals = [k for k in KINDS if k not in _DERIVED for _ in range(counts[k])]
    originals = [originals[i] for i in rng.permutation(len(originals))]
    width = max(6, len(str(sum(counts.values()))))
    plan = [PoolItem(i, f"{i:0{width}d}", kind, None) for i, kind in enumerate(originals)]
    people = [item.index for item in plan if item.kind == "person"]
    n_copies = counts["duplicate"] + counts["near_duplicate"]
    sources = rng.choice(people, size=n_copies, replace=n_copies > len(people)) if n_copies else []
    kinds = ["duplicate"] * counts["duplicate"] + ["near_duplicate"] * counts["near_duplicate"]
    for kind, src in zip(kinds, sources):
        i = len(plan)
        plan.append(PoolItem(i, f"{i:0{width}d}", kind, int(src)))
    return plan


def _person(seed: int, index: int, height: int, width: int,
            keypoint_set: str) -> tuple[PersonSample, str, int]:
    """The person drawn for plan item `index` and how its original file is encoded."""
    sample = render_person(np.random.default_rng([seed, index, 0]), height, width, keypoint_set)
    enc = np.random.default_rng([seed, index, 1])
    ext = ".png" if enc.random() < 0.1 else ".jpg"
    return sample, ext, int(enc.integers(85, 97))


def _make_item(seed: int, item: PoolItem, out_dir: Path, height: int, width: int,
               keypoint_set: str = "coco17") -> dict:
    rng = np.random.default_rng([seed, item.index, 2])
    sample, data, ext = None, None, ".jpg"
    if item.kind == "person":
        sample, ext, quality = _person(seed, item.index, height, width, keypoint_set)
        data = encode_image(sample.image, ext, quality)
    elif item.kind == "duplicate":
        sample, src_ext, src_quality = _person(seed, item.source, height, width, keypoint_set)
        quality = int(rng.integers(70, 84)) if src_ext == ".png" else int(rng.integers(70, src_quality))
        data = encode_image(sample.image, ext, quality)
    elif item.kind == "near_duplicate":
        source = _person(seed, item.source, height, width, keypoint_set)[0].image
        data = encode_image(junk.near_duplicate(rng, source), ext, int(rng.integers(80, 96)))
    elif item.kind == "no_person":
        data = encode_image(junk.no_person(rng, height, width), ext, int(rng.integers(80, 96)))
    elif item.kind == "too_small":
        small = int(rng.choice([24, 32, 40]))
        image = render_person(rng, small, small * 3 // 4).image
        data = encode_image(image, ext, int(rng.integers(80, 96)))
    else:
        sample = render_person(np.random.default_rng([seed, item.index, 0]), height, width,
                               keypoint_set)
        if item.kind == "text_overlay":
            data = encode_image(junk.text_overlay(rng, sample.image), ext, int(rng.integers(80, 96)))
        elif item.kind == "blurred":
            data = encode_image(junk.blurred(rng, sample.image), ext, int(rng.integers(80, 96)))
        else:
            data, sample = junk.corrupt(rng, sample.image), None
    path = Path("images") / f"{item.id}{ext}"
    (out_dir / path).write_bytes(data)
    if sample is not None:
        write_sample(out_dir / "labels" / f"{item.id}.npz", sample)
    status, reason = EXPECTED[item.kind]
    return {"id": item.id, "path": path.as_posix(), "kind": item.kind, "source_id": None,
            "expected_status": status, "expected_reason": reason}


def _worker_init() -> None:
    cv2.setNumThreads(1)  # the pool already uses every core; nested threads only contend


def _run(args: tuple) -> dict:
    return _make_item(*args)


def generate_pool(out_dir: str | Path, n_people: int, seed: int, height: int = 128, width: int = 96,
                  distractors: DistractorMix = DistractorMix(), workers: int = 2,
                  progress: bool = True, keypoint_set: str = "coco17") -> pd.DataFrame:
    """Write images/, labels/ and pool_labels.parquet under out_dir and return the table.

    Labels (.npz) are written for every image whose geometry is the rendered person's own:
    people, exact duplicates, text overlays and blurred images. keypoint_set "sapiens308"
    labels the 308-keypoint whole-body set instead of the 17 COCO keypoints (same images).
    """
    out_dir = Path(out_dir).resolve()  # workers need not share the caller's working directory
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    (out_dir / "labels").mkdir(parents=True, exist_ok=True)
    plan = plan_pool(n_people, seed, distractors)
    jobs = [(seed, item, out_dir, height, width, keypoint_set) for item in plan]
    bar = dict(total=len(jobs), desc="synth pool", unit="img", disable=not progress)
    if workers <= 1:
        rows = [_run(job) for job in tqdm(jobs, **bar)]
    else:
        # forkserver: workers never inherit a parent's threads (torch, OpenCV) mid-flight.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["sapiens2.data.synth.pool"])
        with ctx.Pool(workers, initializer=_worker_init) as pool:
            rows = list(tqdm(pool.imap(_run, jobs, chunksize=8), **bar))
    table = pd.DataFrame(rows, columns=["id", "path", "kind", "source_id", "expected_status",
                                       "expected_reason"])
    by_index = {item.index: item.id for item in plan}
    table["source_id"] = [by_index[item.source] if item.source is not None else None for item in plan]
    table.to_parquet(out_dir / "pool_labels.parquet", index=False)
    return table
