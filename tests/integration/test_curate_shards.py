"""The sharded pool: append-only shards, per-shard score files, resume after a kill, one manifest.

A run killed with SIGKILL mid-pool (the worst case: no cleanup runs) is started again and must
skip every shard whose score file was complete, filter the rest, and write the same manifest
bytes as a run that was never interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipelines.common.shard_scores import filter_shard, score_path, shard_is_filtered
from pipelines.curate import curate
from sapiens2.curation import CurationConfig
from sapiens2.curation.pool import INDEX, open_pool, shard_pool
from sapiens2.data.synth import generate_pool

CHEAP = CurationConfig(workers=1, stages=("size", "phash", "quality"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pool")
    generate_pool(root, n_people=48, seed=3, workers=2, progress=False)
    return root


def _tar_state(shards: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(shards.glob("pool-*.tar"))}


def test_sharding_is_deterministic_and_append_only(pool: Path, tmp_path: Path) -> None:
    images = sorted((pool / "images").iterdir())
    first = shard_pool(pool, tmp_path / "a", shard_size=10)
    again = shard_pool(pool, tmp_path / "b", shard_size=10)
    assert [t[0] for t in _tar_state(tmp_path / "a").values()] == [t[0] for t in _tar_state(tmp_path / "b").values()]
    assert first.index.equals(again.index)
    assert len(first.names) == -(-len(images) // 10)
    assert sorted(first.index["source_path"]) == [p.name for p in images]

    # New files land in new shards; the old shards are not rewritten.
    before = _tar_state(tmp_path / "a")
    extra = pool.parent / f"{pool.name}-grown"
    (extra / "images").mkdir(parents=True)
    for p in images:
        os.link(p, extra / "images" / p.name)
    (extra / "images" / "zz_new.jpg").write_bytes(images[0].read_bytes()[:-1] + b"\xd9")
    (extra / "images" / "aa_new.png").write_bytes(images[1].read_bytes())
    grown = shard_pool(extra, tmp_path / "a", shard_size=10)
    after = _tar_state(tmp_path / "a")
    assert {k: after[k] for k in before} == before
    assert grown.names == [*first.names, f"pool-{len(first.names):05d}"]
    assert sorted(grown.rows(grown.names[-1])["source_path"]) == ["aa_new.png", "zz_new.jpg"]

    # Same bytes written again (a regenerated pool): nothing is packed; the index learns the time.
    rewritten = extra / "images" / images[3].name
    data = rewritten.read_bytes()
    rewritten.unlink()
    rewritten.write_bytes(data)
    same = shard_pool(extra, tmp_path / "a", shard_size=10)
    assert _tar_state(tmp_path / "a") == after and same.names == grown.names
    assert int(same.index.set_index("source_path").loc[images[3].name, "mtime_ns"]) == rewritten.stat().st_mtime_ns

    # A recorded file that changed makes every shard stale: the pool is packed again.
    (extra / "images" / images[2].name).unlink()
    (extra / "images" / images[2].name).write_bytes(b"changed")
    repacked = shard_pool(extra, tmp_path / "a", shard_size=10)
    assert repacked.names[0] == "pool-00000" and len(repacked.index) == len(images) + 2
    assert repacked.digest("pool-00000") != grown.digest("pool-00000")


def test_a_damaged_shard_member_is_named(pool: Path, tmp_path: Path) -> None:
    shards = shard_pool(pool, tmp_path / "s", shard_size=8)
    tar = shards.tar_path("pool-00001")
    with tarfile.open(tar) as archive:
        member = next(m for m in archive.getmembers() if m.size > 100)
    data = bytearray(tar.read_bytes())
    data[member.offset_data + 50] ^= 0xFF
    tar.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"pool-00001\.tar: member .* does not match the sha256"):
        filter_shard(shards, "pool-00001", tmp_path / "scores", CHEAP)


def test_manifest_does_not_depend_on_the_shard_size(pool: Path, tmp_path: Path) -> None:
    small = curate(pool, tmp_path / "small", CHEAP.model_copy(update={"shard_size": 7}))
    whole = curate(pool, tmp_path / "whole", CHEAP.model_copy(update={"shard_size": 10_000}))
    assert small.manifest_path.read_bytes() == whole.manifest_path.read_bytes()
    assert len(open_pool(tmp_path / "small.work" / "shards").names) > 1
    assert len(open_pool(tmp_path / "whole.work" / "shards").names) == 1


def test_a_score_file_is_reused_only_for_the_same_files_and_config(pool: Path, tmp_path: Path) -> None:
    shards = shard_pool(pool, tmp_path / "s", shard_size=16)
    scores = tmp_path / "scores"
    filter_shard(shards, "pool-00000", scores, CHEAP)
    assert shard_is_filtered(shards, "pool-00000", scores, CHEAP)
    assert shard_is_filtered(shards, "pool-00000", scores, CHEAP.model_copy(update={"workers": 2, "shard_size": 5}))
    assert not shard_is_filtered(shards, "pool-00000", scores, CHEAP.model_copy(update={"min_sharpness": 1.0}))
    assert not shard_is_filtered(shards, "pool-00001", scores, CHEAP)
    score_path(scores, "pool-00000").write_bytes(b"not parquet")
    assert not shard_is_filtered(shards, "pool-00000", scores, CHEAP)


def test_a_killed_run_resumes_from_the_last_finished_shard(pool: Path, tmp_path: Path) -> None:
    config = CurationConfig(workers=1, shard_size=6)
    config_file = tmp_path / "params.yaml"
    config_file.write_text(yaml.safe_dump({"curation": config.model_dump(mode="json")}))
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "pipelines.curate", "--input", str(pool), "--output", str(out),
           "--config", str(config_file), "--work", str(work)]
    # The step records an MLflow run: into this test's folder, not the project's.
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"SAPIENS2_WORKSPACE": str(tmp_path)}
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    scores = work / "scores"
    deadline = time.monotonic() + 300
    while len(list(scores.glob("pool-*.parquet"))) < 2:
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no shard finished in 300 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = {p.name: p.stat().st_mtime_ns for p in scores.glob("pool-*.parquet")}
    n_shards = len(open_pool(work / "shards").names)
    assert 2 <= len(finished) < n_shards, f"killed after {len(finished)} of {n_shards} shards"
    assert not (out / "manifest.parquet").exists()

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True, env=env)
    assert f"resuming, {len(finished)} of {n_shards} shards already filtered" in resumed.stdout
    assert {name: (scores / name).stat().st_mtime_ns for name in finished} == finished  # not filtered again
    assert len(list(scores.glob("pool-*.parquet"))) == n_shards

    clean = curate(pool, tmp_path / "clean", config)
    assert (out / "manifest.parquet").read_bytes() == clean.manifest_path.read_bytes()
    manifest = pd.read_parquet(out / "manifest.parquet")
    assert len(manifest) == len(pd.read_parquet(work / "shards" / INDEX))
