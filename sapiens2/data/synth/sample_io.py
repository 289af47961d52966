"""Label files (.npz) and image encoding, byte-for-byte reproducible."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import IO

import cv2
import numpy as np

from sapiens2.data.synth.person import PersonSample
from sapiens2.data.npz import open_npz

LABEL_KEYS = ("keypoints", "seg", "mask", "normal", "pointmap", "albedo", "K", "bbox")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed zip timestamps: np.savez stamps the current time


def write_label_arrays(path: str | Path | IO[bytes], arrays: dict[str, np.ndarray]) -> None:
    """Write named arrays as an npz whose bytes depend only on the arrays (fixed timestamps)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_EPOCH)
            zf.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)


def write_sample(path: str | Path, sample: PersonSample) -> None:
    """Write the labels of `sample` (not its image) as an npz; normals are stored as float16."""
    arrays = {key: getattr(sample, key) for key in LABEL_KEYS}
    arrays["normal"] = arrays["normal"].astype(np.float16)
    write_label_arrays(path, arrays)


def read_sample(path: str | Path) -> dict[str, np.ndarray]:
    """Labels written by `write_sample`; normals come back as float32."""
    with open_npz(path) as data:
        out = {key: data[key] for key in LABEL_KEYS}
    out["normal"] = out["normal"].astype(np.float32)
    return out


def encode_image(image: np.ndarray, ext: str, quality: int = 95) -> bytes:
    """Encode an RGB uint8 image as .jpg (given quality) or .png."""
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)] if ext == ".jpg" else []
    ok, buf = cv2.imencode(ext, np.ascontiguousarray(image[..., ::-1]), params)
    if not ok:
        raise ValueError(f"could not encode image as {ext}")
    return buf.tobytes()
