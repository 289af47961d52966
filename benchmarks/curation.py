"""Benchmark the default curation chain on a pool of --size px JPEGs against a bare Pillow decode.

Builds a pool of --images JPEGs (long side --size, quality 90) in a temporary folder: real
photographs shipped inside installed packages (matplotlib's grace_hopper.jpg; scikit-learn's
china.jpg and flower.jpg and scikit-image's astronaut, chelsea, coffee and rocket when those are
installed) and synthetic people (`render_person`), each randomly cropped (85-100 % of each side)
and brightened (x0.85-1.15) before the resize, plus 5 % exact byte copies. The pool is a pure
function of --seed and --size.

Prints one JSON object with three measurements over the same files:

* `bare_decode_images_per_s`: `Image.open(p).convert("RGB")` + `np.asarray` of every file in
  this process, the floor any chain that looks at full-resolution pixels has to pay;
* `chain_images_per_s`: `curate(pool, out, CurationConfig(workers=--workers))` end to end (worker
  start-up, filters, dedup, manifest, copies of the kept images and report.md), with
  `ratio_chain_to_bare_decode`;
* `stage_seconds` / `stage_share`: the chain again with one worker (no process pool, OpenCV on
  one thread), as `CurationSummary.stage_seconds` times it: `decode` (content hash + decode),
  each registered stage in order, `embed` when enabled, then the global `dedup` (with its ORB
  re-decodes), `balance`, `write` (manifest and copies) and `report`; `other` is the rest
  (listing, ids, splits), so the shares sum to 1. `single_process_chain_images_per_s` is that
  run's rate; its decisions must equal the multi-worker run's. `shard` is packing the pool into
  tar shards (``sapiens2.curation.pool``), which every run pays once per new file;
* `ratio_draft_to_full_decode`: the per-image seconds (decode + stages, one worker) of the default
  chain, which decodes JPEGs in draft mode at the largest input side its stages need, over the
  same chain with `draft_decode=False` (full-resolution decode); `full_decode_status_counts`
  shows whether the reduced decode changed any decision.

Wall times depend on whatever else runs on the machine; `load_avg_1m` says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from matplotlib import cbook
from PIL import Image

from pipelines.curate import curate
from sapiens2.curation.pool import list_inputs
from sapiens2.curation import CurationConfig
from sapiens2.data.synth import render_person

PHOTO_SHARE, COPY_SHARE = 0.2, 0.05
RENDER_LONG_SIDE = 512  # people are rendered at most this tall (ray casting grows with pixels), then resized


def photographs() -> dict[str, np.ndarray]:
    """RGB photographs shipped inside installed packages, by name."""
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        photos = {"grace_hopper": np.asarray(img.convert("RGB"))}
    try:
        from sklearn.datasets import load_sample_image

        photos |= {name: load_sample_image(f"{name}.jpg") for name in ("china", "flower")}
    except ImportError:
        pass
    try:
        from skimage import data

        photos |= {name: getattr(data, name)()[..., :3] for name in ("astronaut", "chelsea", "coffee", "rocket")}
    except ImportError:
        pass
    return photos


def vary(rng: np.random.Generator, image: np.ndarray, size: int) -> np.ndarray:
    """A random crop of 85-100 % of each side, brightness x0.85-1.15, resized to long side ``size``."""
    height, width = image.shape[:2]
    crop_h, crop_w = (round(side * rng.uniform(0.85, 1.0)) for side in (height, width))
    y, x = rng.integers(0, height - crop_h + 1), rng.integers(0, width - crop_w + 1)
    crop = np.clip(image[y:y + crop_h, x:x + crop_w] * rng.uniform(0.85, 1.15), 0, 255).astype(np.uint8)
    scale = size / max(crop_h, crop_w)
    return cv2.resize(crop, (round(crop_w * scale), round(crop_h * scale)),
                      interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC)


def build_pool(images_dir: Path, n: int, size: int, seed: int) -> dict[str, Any]:
    """Write the pool's JPEGs into ``images_dir``; returns its composition."""
    photos = photographs()
    names = sorted(photos)
    n_photos, n_copies = round(n * PHOTO_SHARE), round(n * COPY_SHARE)
    kinds = ["photo"] * n_photos + ["person"] * (n - n_photos - n_copies)
    kinds = [kinds[i] for i in np.random.default_rng(seed).permutation(len(kinds))]
    render_h = min(size, RENDER_LONG_SIDE)
    images_dir.mkdir(parents=True)
    for i, kind in enumerate(kinds):
        rng = np.random.default_rng([seed, i])
        if kind == "photo":
            base = photos[names[rng.integers(len(names))]]
        else:
            base = render_person(rng, render_h, render_h * 3 // 4).image
        Image.fromarray(vary(rng, base, size)).save(images_dir / f"{i:06d}.jpg", quality=90)
    rng = np.random.default_rng([seed, len(kinds)])
    for j in range(n_copies):
        source = images_dir / f"{rng.integers(len(kinds)):06d}.jpg"
        shutil.copyfile(source, images_dir / f"{len(kinds) + j:06d}.jpg")
    return {"photos": n_photos, "people": len(kinds) - n_photos, "exact_copies": n_copies, "photo_sources": names}


def bare_decode_seconds(files: list[Path]) -> float:
    start = time.perf_counter()
    for path in files:
        with Image.open(path) as img:
            np.asarray(img.convert("RGB"))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=1024, help="long side of every pool image, px")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="build the pool here (a new folder) and leave it for inspection")
    args = parser.parse_args()
    if args.keep is not None and args.keep.exists():
        parser.error(f"--keep {args.keep} already exists")

    with tempfile.TemporaryDirectory() as tmp:
        pool = (args.keep or Path(tmp) / "pool").resolve()
        composition = build_pool(pool / "images", args.images, args.size, args.seed)
        files = list_inputs(pool)
        bare_s = bare_decode_seconds(files)
        summary = curate(pool, Path(tmp) / "chain", CurationConfig(workers=args.workers))
        single = curate(pool, Path(tmp) / "single", CurationConfig(workers=1))
        full = curate(pool, Path(tmp) / "full", CurationConfig(workers=1, draft_decode=False))
    if single.status_counts != summary.status_counts:
        raise SystemExit(f"one worker decided {single.status_counts}, {args.workers} workers {summary.status_counts}")

    def per_image(run) -> float:  # decode + every per-image stage: the part draft decoding changes
        return sum(v for k, v in run.stage_seconds.items() if k not in ("shard", "dedup", "balance", "write", "report"))

    seconds = {**single.stage_seconds, "other": single.seconds - sum(single.stage_seconds.values())}
    total = single.seconds
    bare_rate = len(files) / bare_s
    print(json.dumps({
        "images": len(files), "size": args.size, "workers": args.workers, "seed": args.seed, "pool": composition,
        "bare_decode_images_per_s": round(bare_rate, 1),
        "chain_images_per_s": round(summary.images_per_second, 1),
        "ratio_chain_to_bare_decode": round(summary.images_per_second / bare_rate, 3),
        "single_process_chain_images_per_s": round(len(files) / total, 1),
        "ratio_single_process_to_bare_decode": round(len(files) / total / bare_rate, 3),
        "per_image_seconds_draft": round(per_image(single), 3),
        "per_image_seconds_full_decode": round(per_image(full), 3),
        "ratio_draft_to_full_decode": round(per_image(single) / per_image(full), 3),
        "full_decode_status_counts": full.status_counts,
        "stage_seconds": {name: round(s, 3) for name, s in seconds.items()},
        "stage_share": {name: round(s / total, 4) for name, s in seconds.items()},
        "status_counts": summary.status_counts,
        "reason_counts": {reason: n for reason, n in summary.reason_counts.items() if n},
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
