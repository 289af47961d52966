"""Readers and writers of the label formats users bring and the reference release uses.

Every reader yields samples in CuratedDataset's dict layout (see `common`), checked as the
dataset checks them, so a malformed file fails with its path and field; every writer takes such
samples. `write_manifest` turns any of them into our curated format for training.

    coco       COCO / COCO-WholeBody keypoint JSON + images        read_coco / write_coco
    seglabels  images/ + labels/<id>.png class-id maps             read_seglabels / write_seglabels
    dense      rgb/ mask/ normal/ depth/ camera_*/ albedo/         read_dense / write_dense
    manifest   manifest.parquet + images/ + labels/<id>.npz        read_manifest / write_manifest
    shards     shards.json + shards/<split>-<NNNNN>.parquet        read_shards / write_shards
"""

from sapiens2.data.formats.coco import read_coco, write_coco
from sapiens2.data.formats.dense import read_dense, write_dense
from sapiens2.data.formats.manifest import read_manifest, write_manifest
from sapiens2.data.formats.seglabels import read_seglabels, write_seglabels
from sapiens2.data.formats.shards import read_shards, write_shards

WRITERS = {
    "coco": write_coco,
    "seglabels": write_seglabels,
    "dense": write_dense,
    "manifest": write_manifest,
    "shards": write_shards,
}

__all__ = [
    "WRITERS", "read_coco", "read_dense", "read_manifest", "read_seglabels", "read_shards",
    "write_coco", "write_dense", "write_manifest", "write_seglabels", "write_shards",
]
