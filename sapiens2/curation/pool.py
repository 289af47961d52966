"""The raw image pool as shards: tar files of images plus one Parquet index.

A shard is the unit of parallel and resumable curation: each is filtered on its own (one Dagster
partition, one Kubernetes pod at scale) into one score file, and a killed run restarts at the
first shard without a finished score file. ``shards_dir`` holds ``pool-NNNNN.tar`` (members named
by the file's path under the pool's image folder) and ``pool.parquet`` (``id``, ``source_path``,
``shard``, ``size``, ``sha256``, ``mtime_ns``), written last, so an index always describes
complete shards.

Sharding is append-only: files new since the last index go into new shards and existing shards
stay byte for byte, so their score files stay valid. If a file the index records has changed or
gone, the pool is re-sharded from scratch (and every shard is filtered again). Like make and
rsync, a recorded file whose size and modification time are unchanged is taken as unchanged;
only the others are hashed, so bringing a large pool up to date costs a ``stat`` per file.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

INDEX = "pool.parquet"
INDEX_COLUMNS = ("id", "source_path", "shard", "size", "sha256", "mtime_ns")


def image_root(input_dir: Path) -> Path:
    """A pool's images live under ``images/`` when it has one (labels beside it), else at its top."""
    return input_dir / "images" if (input_dir / "images").is_dir() else input_dir


def regular_files(root: Path) -> list[Path]:
    """Every file under `root` (one walk); raises ValueError naming the first symbolic link or
    special file (FIFO, socket, device): a link can point anywhere outside the pool (and would be
    packed, copied and pushed to the DVC remote as if it were pool data), a FIFO blocks the reader."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk never follows directory links
        for kind, names in (("dir", dirnames), ("file", filenames)):
            for name in names:
                path = Path(dirpath) / name
                if path.is_symlink():
                    raise ValueError(f"{path}: a symbolic link (to {os.readlink(path)}) in the pool; "
                                     "links may point outside it, so replace the link with the file itself")
                if not (path.is_dir() or path.is_file()):
                    raise ValueError(f"{path}: not a regular file (FIFO, socket or device) in the pool")
                if kind == "file":
                    files.append(path)
    return files


def list_inputs(input_dir: Path) -> list[Path]:
    """Every non-hidden file under the image root, sorted; ids (file stems) must be unique and
    the pool may hold no links or special files (`regular_files`)."""
    root = image_root(input_dir)
    files = sorted(p for p in regular_files(root)
                   if not any(part.startswith(".") for part in p.relative_to(root).parts))
    seen: dict[str, Path] = {}
    for path in files:
        if path.stem in seen:
            raise ValueError(f"two input files share the id {path.stem!r}: {seen[path.stem]} and {path}")
        seen[path.stem] = path
    return files


def shard_name(number: int) -> str:
    return f"pool-{number:05d}"


@dataclass(frozen=True)
class PoolShards:
    """A sharded pool: ``index`` rows in shard order, then source path order within a shard."""

    root: Path
    index: pd.DataFrame

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(self.index["shard"]))

    def rows(self, shard: str) -> pd.DataFrame:
        rows = self.index[self.index["shard"] == shard]
        if rows.empty:
            raise KeyError(f"{self.root / INDEX}: no shard named {shard!r}")
        return rows

    def digest(self, shard: str) -> str:
        """Content identity of a shard: the hash of its members' paths and sha256s, in order."""
        rows = self.rows(shard)
        return hashlib.sha256("\n".join(f"{p} {h}" for p, h in zip(rows["source_path"], rows["sha256"])).encode()
                              ).hexdigest()

    def tar_path(self, shard: str) -> Path:
        return self.root / f"{shard}.tar"

    def iter_shard(self, shard: str) -> Iterator[tuple[str, bytes]]:
        """(source_path, bytes) of every member, in index order; a member whose bytes no longer
        match the index is an error naming the shard and the member."""
        rows = self.rows(shard)
        with tarfile.open(self.tar_path(shard)) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for source_path, sha256 in zip(rows["source_path"], rows["sha256"]):
                data = _member_bytes(tar, members, source_path, self.tar_path(shard))
                if hashlib.sha256(data).hexdigest() != sha256:
                    raise ValueError(f"{self.tar_path(shard)}: member {source_path!r} does not match the "
                                     f"sha256 in {self.root / INDEX}")
                yield source_path, data

    def read(self, source_paths: Sequence[str]) -> list[bytes]:
        """The bytes of the given files, in the order asked; each shard's tar is opened once."""
        where = dict(zip(self.index["source_path"], self.index["shard"]))
        by_shard: dict[str, list[str]] = {}
        for path in dict.fromkeys(source_paths):
            by_shard.setdefault(where[path], []).append(path)
        out: dict[str, bytes] = {}
        for shard, paths in by_shard.items():
            with tarfile.open(self.tar_path(shard)) as tar:
                members = {m.name: m for m in tar.getmembers()}
                out |= {path: _member_bytes(tar, members, path, self.tar_path(shard)) for path in paths}
        return [out[p] for p in source_paths]


def _member_bytes(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str, tar_path: Path) -> bytes:
    if name not in members:
        raise KeyError(f"{tar_path}: member {name!r} listed in the pool index is missing")
    return tar.extractfile(members[name]).read()


def open_pool(shards_dir: str | Path) -> PoolShards:
    shards_dir = Path(shards_dir)
    index = pd.read_parquet(shards_dir / INDEX)
    missing = [c for c in INDEX_COLUMNS if c not in index]
    if missing:
        raise ValueError(f"{shards_dir / INDEX}: missing column(s) {missing}")
    return PoolShards(shards_dir, index)


def _write_tar(path: Path, members: Sequence[tuple[str, bytes]]) -> None:
    """A tar whose bytes depend only on the members' names and contents (no times, owners)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def _write_index(shards_dir: Path, index: pd.DataFrame) -> None:
    tmp = shards_dir / f".{INDEX}.tmp"
    index.to_parquet(tmp, index=False)
    os.replace(tmp, shards_dir / INDEX)


def _current_mtime(path: Path | None, size: int, mtime_ns: int, sha256: str) -> int | None:
    """The recorded file's modification time now, or None when it is gone or its bytes differ;
    the content is hashed only when size or time changed."""
    if path is None:
        return None
    stat = path.stat()
    if stat.st_size == size and stat.st_mtime_ns == mtime_ns:
        return mtime_ns
    return stat.st_mtime_ns if hashlib.sha256(path.read_bytes()).hexdigest() == sha256 else None


def shard_pool(input_dir: str | Path, shards_dir: str | Path, shard_size: int) -> PoolShards:
    """Bring ``shards_dir`` up to date with the files under ``input_dir`` (see the module docstring)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    input_dir, shards_dir = Path(input_dir), Path(shards_dir)
    root = image_root(input_dir)
    files = {p.relative_to(root).as_posix(): p for p in list_inputs(input_dir)}
    shards_dir.mkdir(parents=True, exist_ok=True)
    index = pd.DataFrame(columns=list(INDEX_COLUMNS))
    if (shards_dir / INDEX).is_file():
        index = open_pool(shards_dir).index
        mtimes = [_current_mtime(files.get(p), size, mtime, sha256)
                  for p, size, mtime, sha256 in zip(index["source_path"], index["size"], index["mtime_ns"], index["sha256"])]
        if None in mtimes:
            # A recorded file changed or went: its shard (and every score file) is stale.
            for stale in shards_dir.glob("pool-*.tar"):
                stale.unlink()
            index = pd.DataFrame(columns=list(INDEX_COLUMNS))
        elif mtimes != list(index["mtime_ns"]):
            # Rewritten with the same bytes (a regenerated pool): remember the new times, so the
            # next sync does not hash them again.
            index = index.assign(mtime_ns=mtimes)
            _write_index(shards_dir, index)
    new = sorted(set(files) - set(index["source_path"]))
    first = 1 + max((int(s.split("-")[1]) for s in index["shard"]), default=-1)
    added = []
    for k in range(0, len(new), shard_size):
        chunk, shard = new[k:k + shard_size], shard_name(first + k // shard_size)
        members = [(rel, files[rel].read_bytes()) for rel in chunk]
        _write_tar(shards_dir / f"{shard}.tar", members)
        added += [{"id": files[rel].stem, "source_path": rel, "shard": shard, "size": len(data),
                   "sha256": hashlib.sha256(data).hexdigest(), "mtime_ns": files[rel].stat().st_mtime_ns}
                  for rel, data in members]
    if added or not (shards_dir / INDEX).is_file():
        index = pd.concat([index, pd.DataFrame(added, columns=list(INDEX_COLUMNS))], ignore_index=True)
        index = index.astype({"id": str, "source_path": str, "shard": str, "size": "int64", "sha256": str,
                              "mtime_ns": "int64"})
        _write_index(shards_dir, index)
    return open_pool(shards_dir)
