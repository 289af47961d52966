"""COCO / COCO-WholeBody keypoint annotations: `annotations.json` plus an image folder.

One sample per person annotation (top-down pose). The keypoint array concatenates, in
COCO-WholeBody order, the arrays of `parts` that the annotation has: "keypoints" (17 body),
"foot_kpts" (6), "face_kpts" (68), "lefthand_kpts" (21), "righthand_kpts" (21); the count must be
`num_keypoints` (17 for our set today, 133 for WholeBody). Coordinates are kept as written (our
pixel-centre convention when we wrote them); visibility 0/1/2 as in COCO. `bbox` [x, y, w, h]
becomes x0, y0, x1, y1; a `segmentation` (RLE or polygons) becomes the person mask. K, seg and
dense maps do not exist in this format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pycocotools import mask as mask_utils

from sapiens2.data.formats.common import check_sample, read_rgb, unique_ids, write_png
from sapiens2.labels import COCO_KEYPOINT_NAMES, COCO_SKELETON

WHOLEBODY_PARTS = ("keypoints", "foot_kpts", "face_kpts", "lefthand_kpts", "righthand_kpts")
WHOLEBODY_COUNTS = (17, 6, 68, 21, 21)
ANNOTATION_FILE = "annotations.json"


def _keypoints(ann: dict, parts: Sequence[str] | None, where: str, expected: int) -> np.ndarray:
    names = [p for p in WHOLEBODY_PARTS if p in ann] if parts is None else list(parts)
    arrays = []
    for part in names:
        if part not in ann:
            raise ValueError(f"{where}: missing field {part!r}")
        values = np.asarray(ann[part], np.float32)
        if values.ndim != 1 or values.size % 3:
            raise ValueError(
                f"{where}: field {part!r} has {values.size} values, not x, y, v triples"
            )
        arrays.append(values.reshape(-1, 3))
    kpts = np.concatenate(arrays) if arrays else np.zeros((0, 3), np.float32)
    if len(kpts) != expected:
        raise ValueError(
            f"{where}: field 'keypoints' holds {len(kpts)} keypoints ({'+'.join(names)}), "
            f"expected {expected}"
        )
    return kpts


def _mask(segmentation: Any, height: int, width: int, where: str) -> np.ndarray:
    if isinstance(segmentation, dict):
        rle = segmentation
        if isinstance(rle.get("counts"), list):
            rle = mask_utils.frPyObjects(rle, *rle["size"])
        if tuple(rle["size"]) != (height, width):
            raise ValueError(
                f"{where}: field 'segmentation' has size {rle['size']}, image is {[height, width]}"
            )
    else:
        rle = mask_utils.merge(mask_utils.frPyObjects(segmentation, height, width))
    return mask_utils.decode(rle).astype(bool)


def read_coco(
    annotation_file: str | Path,
    image_dir: str | Path | None = None,
    num_keypoints: int = 17,
    parts: Sequence[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Samples of a COCO keypoint file; images under `image_dir` (default: ./images beside it).

    Ids are the image file stem, or "<stem>_<annotation id>" for images with several people.
    """
    annotation_file = Path(annotation_file)
    image_dir = annotation_file.parent / "images" if image_dir is None else Path(image_dir)
    data = json.loads(annotation_file.read_text())
    for key in ("images", "annotations"):
        if key not in data:
            raise ValueError(f"{annotation_file}: missing field {key!r}")
    by_image: dict[Any, list[dict]] = {}
    for ann in data["annotations"]:
        if not ann.get("iscrowd", 0):
            by_image.setdefault(ann["image_id"], []).append(ann)
    for info in sorted(data["images"], key=lambda i: i["id"]):
        anns = by_image.get(info["id"], [])
        if not anns:
            continue
        image = read_rgb(image_dir / info["file_name"])
        height, width = image.shape[:2]
        for field, size in (("height", height), ("width", width)):
            if field in info and int(info[field]) != size:
                raise ValueError(
                    f"{annotation_file}: image {info['file_name']} field {field!r} says "
                    f"{info[field]}, the file has {size}"
                )
        stem = Path(info["file_name"]).stem
        for ann in anns:
            where = f"{annotation_file}: annotation {ann.get('id')} ({info['file_name']})"
            if "bbox" not in ann:
                raise ValueError(f"{where}: missing field 'bbox'")
            x, y, w, h = (float(v) for v in ann["bbox"])
            sample = {
                "id": stem if len(anns) == 1 else f"{stem}_{ann['id']}",
                "image": image,
                "keypoints": _keypoints(ann, parts, where, num_keypoints),
                "bbox": np.array([x, y, x + w, y + h], np.float32),
            }
            if ann.get("segmentation"):
                sample["mask"] = _mask(ann["segmentation"], height, width, where)
            check_sample(sample, where, num_keypoints, num_classes=0)  # no seg in COCO
            yield sample


def _annotation(sample: dict[str, Any], index: int) -> dict[str, Any]:
    kpts = sample["keypoints"]
    flat = [[float(x), float(y), int(v)] for x, y, v in kpts]
    x0, y0, x1, y1 = (float(v) for v in sample["bbox"])
    ann: dict[str, Any] = {
        "id": index, "image_id": index, "category_id": 1, "iscrowd": 0,
        "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0),
        "num_keypoints": int((kpts[:, 2] > 0).sum()),
    }
    if len(kpts) == sum(WHOLEBODY_COUNTS):  # WholeBody: one array per part
        bounds = np.cumsum((0, *WHOLEBODY_COUNTS))
        for part, lo, hi in zip(WHOLEBODY_PARTS, bounds[:-1], bounds[1:], strict=True):
            ann[part] = [v for row in flat[lo:hi] for v in row]
    else:
        ann["keypoints"] = [v for row in flat for v in row]
    if "mask" in sample:
        rle = mask_utils.encode(np.asfortranarray(sample["mask"].astype(np.uint8)))
        ann["segmentation"] = {"size": list(rle["size"]), "counts": rle["counts"].decode("ascii")}
        ann["area"] = int(sample["mask"].sum())
    return ann


def write_coco(
    samples: Iterable[dict[str, Any]],
    output_dir: str | Path,
    keypoint_names: Sequence[str] = COCO_KEYPOINT_NAMES,
    skeleton: Sequence[tuple[int, int]] = COCO_SKELETON,
) -> int:
    """Write images/<id>.png and annotations.json (one person per image); returns the count.

    Samples need "keypoints" and "bbox"; their mask, when present, is stored as RLE.
    """
    output_dir = Path(output_dir)
    images, annotations, count = [], [], 0
    for index, sample in enumerate(unique_ids(samples), start=1):
        for field in ("keypoints", "bbox"):
            if field not in sample:
                raise ValueError(f"sample {sample['id']}: missing field {field!r} for COCO")
        if count and len(sample["keypoints"]) != count:
            raise ValueError(f"sample {sample['id']}: field 'keypoints' has "
                             f"{len(sample['keypoints'])} keypoints, earlier samples {count}")
        count = len(sample["keypoints"])
        file_name = f"{sample['id']}.png"
        write_png(output_dir / "images" / file_name, sample["image"])
        height, width = sample["image"].shape[:2]
        images.append({"id": index, "file_name": file_name, "height": height, "width": width})
        annotations.append(_annotation(sample, index))
    named = count == len(keypoint_names)
    category = {
        "id": 1, "name": "person", "supercategory": "person",
        "keypoints": list(keypoint_names) if named else [f"kp{i}" for i in range(count)],
        "skeleton": [[a + 1, b + 1] for a, b in skeleton] if named else [],
    }
    document = {"images": images, "annotations": annotations, "categories": [category]}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / ANNOTATION_FILE).write_text(json.dumps(document))
    return len(annotations)
