"""Model files fetched from S3 are data, never code: a .pth whose pickle runs a command on load
is refused by `read_state_dict` (weights-only unpickling) and by `sapiens2 import-checkpoint`,
without running the command; safetensors from the same bucket load."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from pipelines.common import s3 as s3mod
from pipelines.cli import main as cli
from sapiens2.model import read_state_dict, save_checkpoint
from tests.integration.test_s3_upload import moto_s3  # noqa: F401  (fixture: moto S3 on a loopback port)


class Payload:
    """Pickles as a call to `os.system`: whatever unpickles it with full pickle runs `command`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _through_s3(local: Path, settings, tmp_path: Path) -> Path:
    stored = s3mod.upload_verified(local, f"checkpoints/{local.name}", settings)
    fetched = tmp_path / "fetched" / local.name
    fetched.parent.mkdir(exist_ok=True)
    bucket, key = stored.uri.removeprefix("s3://").split("/", 1)
    s3mod.client(settings).download_file(bucket, key, str(fetched))
    return fetched


def test_pickle_with_code_from_s3_is_refused_and_never_run(moto_s3, tmp_path: Path, capsys) -> None:  # noqa: F811
    _, settings = moto_s3
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "backbone.pth"
    torch.save({"state_dict": {"patch_embed.proj.weight": torch.zeros(2, 2)}, "meta": Payload(f"touch {marker}")}, evil)
    fetched = _through_s3(evil, settings, tmp_path)

    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        read_state_dict(fetched)
    assert cli(["import-checkpoint", str(fetched), "--output", str(tmp_path / "out.safetensors")]) == 1
    assert "Weights only load failed" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()

    # The file really carries a live payload: full unpickling runs it.
    torch.load(fetched, weights_only=False)
    assert marker.exists()


def test_safetensors_and_plain_weights_from_s3_load(moto_s3, tmp_path: Path) -> None:  # noqa: F811
    _, settings = moto_s3
    module = torch.nn.Linear(3, 2)
    save_checkpoint(module, tmp_path / "linear.safetensors")
    torch.save({"model": module.state_dict()}, tmp_path / "linear.pth")
    for name in ("linear.safetensors", "linear.pth"):
        state = read_state_dict(_through_s3(tmp_path / name, settings, tmp_path))
        assert torch.equal(state["weight"], module.weight.detach()), name
    (tmp_path / "linear.pkl").write_bytes(pickle.dumps(module.state_dict()))
    with pytest.raises(ValueError, match="unsupported checkpoint type '.pkl'"):
        read_state_dict(tmp_path / "linear.pkl")
