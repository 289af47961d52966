"""Label files (.npz) opened with a bound on what their arrays expand to.

An .npz is a zip archive: a few kilobytes can declare gigabytes of deflated zeros, and every
reader of a pool's or a dataset's labels would allocate them. The archive's directory states
each member's uncompressed size, and Python's zip reader never inflates a member past it, so
checking the declared total before loading is enough.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np

# The 308-keypoint, 29-class, float32 normal/pointmap labels of a 4096x3072 image are ~400 MB.
LABEL_MAX_BYTES = 1 << 30


def open_npz(source: str | Path | bytes, max_bytes: int = LABEL_MAX_BYTES, where: str | None = None) -> np.lib.npyio.NpzFile:
    """`np.load` of an .npz (path or bytes), no pickles; ValueError naming `where` (default: the
    path) when it is not an archive or its arrays would expand past `max_bytes`."""
    where = where or ("label data" if isinstance(source, bytes) else str(source))
    opened = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with zipfile.ZipFile(opened) as archive:
            total = sum(member.file_size for member in archive.infolist())
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{where}: not an .npz archive ({exc})") from None
    if total > max_bytes:
        raise ValueError(f"{where}: label arrays expand to {total:,} bytes, over the {max_bytes:,}-byte limit")
    if isinstance(opened, io.BytesIO):
        opened.seek(0)
    return np.load(opened, allow_pickle=False)
