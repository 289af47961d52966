"""Body-part segmentation as PNG label maps: `images/<id>.<ext>` + `labels/<id>.png`.

The label PNG is single-channel (8-bit grey or palette; the pixel value is the class id, 255 =
ignore), the layout of LIP/CIHP-style parsing data sets and MMSegmentation. `class_map`
renames a source data set's ids to ours (unlisted ids become 255, ignored). The person mask is
every pixel of a class other than background and ignore; bbox is measured from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from sapiens2.data.formats.common import (check_sample, images_by_stem, mask_bbox, read_rgb,
                                          require, unique_ids, write_png)
from sapiens2.labels import SEG_CLASSES
from sapiens2.labels import IGNORE_INDEX


def read_label_map(path: Path) -> np.ndarray:
    """A single-channel PNG as (H, W) uint8 class ids."""
    with Image.open(require(path, "label")) as image:
        if image.mode not in ("L", "P"):
            raise ValueError(
                f"{path}: field 'seg' is a {image.mode} image; expected a single-channel "
                "(L or P mode) label map"
            )
        return np.asarray(image, dtype=np.uint8).copy()


def read_seglabels(
    root: str | Path,
    num_classes: int = len(SEG_CLASSES),
    class_map: Mapping[int, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Samples with image, seg, mask and bbox, in id order; every image needs its label map."""
    root = Path(root)
    lut = None
    if class_map is not None:
        lut = np.full(256, IGNORE_INDEX, np.uint8)
        for source, target in class_map.items():
            lut[int(source)] = int(target)
    for stem, image_path in images_by_stem(root / "images").items():
        label_path = root / "labels" / f"{stem}.png"
        seg = read_label_map(label_path)
        if lut is not None:
            seg = lut[seg]
        mask = (seg != 0) & (seg != IGNORE_INDEX)
        sample = {"id": stem, "image": read_rgb(image_path), "seg": seg, "mask": mask,
                  "bbox": mask_bbox(mask)}
        check_sample(sample, label_path, num_keypoints=0, num_classes=num_classes)
        yield sample


def write_seglabels(samples: Iterable[dict[str, Any]], output_dir: str | Path) -> int:
    """Write images/<id>.png and labels/<id>.png for samples with a seg map; returns the count."""
    output_dir, count = Path(output_dir), 0
    for sample in unique_ids(samples):
        if "seg" not in sample:
            raise ValueError(f"sample {sample['id']}: missing field 'seg' for PNG label maps")
        write_png(output_dir / "images" / f"{sample['id']}.png", sample["image"])
        write_png(output_dir / "labels" / f"{sample['id']}.png", sample["seg"].astype(np.uint8))
        count += 1
    return count
