"""CheckpointManager's bookkeeping without an engine: which checkpoint counts as the newest
complete one, which run a checkpoint belongs to, and whether its files are the ones it saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapiens2.train.checkpoint import RECORD, CheckpointManager, CheckpointMismatch, _file_hashes

IDENTITY = {"recipe_sha": "abc", "data_md5": "d1.dir", "backbone_md5": "none", "world_size": "2"}


def _tag(root: Path, step: int, identity: dict | None = IDENTITY, complete: bool = True) -> None:
    tag = root / f"step_{step:08d}"
    tag.mkdir(parents=True)
    if complete:
        (tag / RECORD).write_text(json.dumps({"step": step, "identity": identity}))


def test_latest_pointer_wins_and_a_lost_one_falls_back_to_the_newest_complete_tag(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every_n_steps=2, keep_last=3)
    assert manager.latest_step() is None
    _tag(tmp_path, 2)
    _tag(tmp_path, 4)
    _tag(tmp_path, 6, complete=False)  # killed before every rank had saved
    (tmp_path / "latest").write_text("step_00000002")
    assert manager.latest_step() == 2
    for broken in ("", "step_0000", "step_00000008"):  # empty after a crash, garbled, or gone
        (tmp_path / "latest").write_text(broken)
        assert manager.latest_step() == 4, broken
    (tmp_path / "latest").unlink()
    assert manager.latest_step() == 4


def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(tmp_path: Path) -> None:
    _tag(tmp_path, 4)
    CheckpointManager(tmp_path, 2, 1, identity=dict(IDENTITY)).check_identity(4)
    CheckpointManager(tmp_path, 2, 1).check_identity(4)  # no identity given: nothing to compare
    other = {**IDENTITY, "recipe_sha": "xyz", "world_size": "1"}
    with pytest.raises(CheckpointMismatch, match=r"recipe_sha: saved 'abc', now 'xyz'; world_size: saved '2', now '1'"):
        CheckpointManager(tmp_path, 2, 1, identity=other).check_identity(4)
    _tag(tmp_path, 6, identity=None)
    with pytest.raises(CheckpointMismatch, match="records no run identity"):
        CheckpointManager(tmp_path, 2, 1, identity=dict(IDENTITY)).check_identity(6)


def test_only_the_files_a_checkpoint_saved_are_loaded(tmp_path: Path) -> None:
    """DeepSpeed unpickles its state: a file changed, added or removed since the save is refused."""
    tag = tmp_path / "step_00000004"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"model")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optimizer")
    (tag / RECORD).write_text(json.dumps({"step": 4, "identity": IDENTITY, "files": _file_hashes(tag)}))
    manager = CheckpointManager(tmp_path, 2, 1, identity=dict(IDENTITY))
    manager.check_files(4)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"a pickle with a payload")
    with pytest.raises(CheckpointMismatch, match=r"mp_rank_00_model_states.pt not as saved"):
        manager.check_files(4)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"model")
    (tag / "extra.pt").write_bytes(b"")
    with pytest.raises(CheckpointMismatch, match=r"extra.pt not as saved"):
        manager.check_files(4)
    _tag(tmp_path, 6)  # a record from before checkpoints hashed their files
    with pytest.raises(CheckpointMismatch, match="holds no file hashes"):
        manager.check_files(6)
