"""Our own sharded format: `shards/<split>-<NNNNN>.parquet` files of up to `shard_size` rows
(id, split, height, width, image as PNG bytes, labels as npz bytes stored as write_manifest
stores them, sha256 of image + labels bytes) and the index `shards.json`, written last, that
lists each shard's file, split, row count, byte size and sha256 and the count per split.

`read_shards` checks each shard file against the index and each row against its hash, then
validates the labels as the dataset does; it holds one shard in memory at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sapiens2.data.dataset import labelled_sample
from sapiens2.data.formats.common import require, unique_ids
from sapiens2.data.formats.manifest import stored_labels
from sapiens2.data.npz import open_npz
from sapiens2.data.decode import read_rgb
from sapiens2.data.synth.sample_io import encode_image, write_label_arrays
from sapiens2.labels import SEG_CLASSES

FORMAT = "sapiens2-shards"
VERSION = 1
INDEX = "shards.json"
SHARD_DIR = "shards"
COLUMNS = ("id", "split", "height", "width", "image", "labels", "sha256")
ENTRY_FIELDS = ("file", "split", "rows", "bytes", "sha256")
SPLIT_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _row(sample: dict[str, Any], split: str) -> dict[str, Any]:
    image = encode_image(sample["image"], ".png")
    buffer = io.BytesIO()
    write_label_arrays(buffer, stored_labels(sample))
    labels = buffer.getvalue()
    height, width = sample["image"].shape[:2]
    return {
        "id": str(sample["id"]), "split": split, "height": height, "width": width,
        "image": image, "labels": labels, "sha256": hashlib.sha256(image + labels).hexdigest(),
    }


def _write_shard(output_dir: Path, split: str, number: int, rows: list[dict]) -> dict[str, Any]:
    """Write one shard file; returns its index entry."""
    buffer = io.BytesIO()
    pd.DataFrame(rows, columns=list(COLUMNS)).to_parquet(buffer, index=False)
    data = buffer.getvalue()
    name = f"{SHARD_DIR}/{split}-{number:05d}.parquet"
    (output_dir / name).write_bytes(data)
    return {"file": name, "split": split, "rows": len(rows), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def write_shards(
    samples: Iterable[dict[str, Any]],
    output_dir: str | Path,
    split: str | Mapping[str, str] = "train",
    shard_size: int = 256,
) -> int:
    """Write samples as parquet shards of up to `shard_size` rows per split, then shards.json;
    `split` names one split for all samples or maps id -> split. Returns the count."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    output_dir = Path(output_dir)
    (output_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    pending: dict[str, list[dict]] = {}
    counts: dict[str, int] = {}
    shards: list[dict[str, Any]] = []
    for sample in unique_ids(samples):
        name = split if isinstance(split, str) else split[str(sample["id"])]
        if not SPLIT_NAME.fullmatch(name):
            raise ValueError(f"sample {sample['id']}: split {name!r} is not usable in a file name")
        rows = pending.setdefault(name, [])
        rows.append(_row(sample, name))
        counts[name] = counts.get(name, 0) + 1
        if len(rows) == shard_size:
            number = counts[name] // shard_size - 1
            shards.append(_write_shard(output_dir, name, number, pending.pop(name)))
    for name, rows in pending.items():
        shards.append(_write_shard(output_dir, name, counts[name] // shard_size, rows))
    index = {"format": FORMAT, "version": VERSION, "shards": shards, "counts": counts}
    temp = output_dir / f"{INDEX}.tmp"
    temp.write_text(json.dumps(index, indent=1))
    os.replace(temp, output_dir / INDEX)
    return sum(counts.values())


def _read_index(path: Path) -> list[dict[str, Any]]:
    """The shard entries of a checked index."""
    if not path.is_file():
        raise ValueError(f"{path}: missing index file")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    for field, expected in (("format", FORMAT), ("version", VERSION)):
        if index.get(field) != expected:
            raise ValueError(
                f"{path}: field {field!r} is {index.get(field)!r}, expected {expected!r}"
            )
    if not isinstance(index.get("shards"), list):
        raise ValueError(f"{path}: missing field 'shards'")
    for number, entry in enumerate(index["shards"]):
        absent = [f for f in ENTRY_FIELDS if f not in entry]
        if absent:
            raise ValueError(f"{path}: shard entry {number} missing field(s) {absent}")
    return index["shards"]


def _load_shard(path: Path, entry: dict[str, Any]) -> pd.DataFrame:
    """The rows of a shard file whose size, hash and row count match its index entry."""
    data = require(path, "shard").read_bytes()
    for field, actual in (("bytes", len(data)), ("sha256", hashlib.sha256(data).hexdigest())):
        if actual != entry[field]:
            raise ValueError(
                f"{path}: field {field!r} in {INDEX} says {entry[field]}, the file has {actual}"
            )
    rows = pd.read_parquet(io.BytesIO(data))
    absent = [c for c in COLUMNS if c not in rows.columns]
    if absent:
        raise ValueError(f"{path}: missing column(s) {absent}")
    if len(rows) != entry["rows"]:
        raise ValueError(
            f"{path}: field 'rows' in {INDEX} says {entry['rows']}, the file has {len(rows)}"
        )
    return rows


def read_shards(
    root: str | Path, split: str | None = None, fields: Sequence[str] | None = None,
    num_keypoints: int = 17, num_classes: int = len(SEG_CLASSES),
) -> Iterator[dict[str, Any]]:
    """Samples of `split` (all splits when None) in stored order, one shard read at a time.

    fields=None yields every label array a row holds; otherwise each must be present.
    """
    root = Path(root)
    for entry in _read_index(root / INDEX):
        if split is not None and entry["split"] != split:
            continue
        path = root / entry["file"]
        for row in _load_shard(path, entry).itertuples(index=False):
            where = f"{path}: row {row.id}"
            image_bytes, label_bytes = bytes(row.image), bytes(row.labels)
            digest = hashlib.sha256(image_bytes + label_bytes).hexdigest()
            if digest != row.sha256:
                raise ValueError(
                    f"{where}: field 'sha256' says {row.sha256}, image + labels hash to {digest}"
                )
            try:
                image = read_rgb(image_bytes)
            except ValueError:
                raise ValueError(f"{where}: field 'image' is not a readable image") from None
            for field, expected in (
                ("split", entry["split"]), ("height", image.shape[0]), ("width", image.shape[1])
            ):
                if getattr(row, field) != expected:
                    raise ValueError(
                        f"{where}: field {field!r} is {getattr(row, field)}, expected {expected}"
                    )
            with open_npz(label_bytes, where=f"{where}: field 'labels'") as npz:
                sample = labelled_sample(
                    str(row.id), image, npz, fields, num_keypoints, num_classes, where
                )
            yield sample
