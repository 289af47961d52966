"""The pretraining program end to end: 2 DeepSpeed ranks (ZeRO-3, gloo on CPU), checkpoints, a run
killed after a checkpoint that resumes to the same weights as an uninterrupted run, and the same
run launched as two "nodes" on loopback (the Kubernetes Job's layout) giving the same weights."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from sapiens2.data.synth import render_person
from tests.conftest import SMALL_RECIPE

STEPS = 8
SETTINGS = [f"{k}={v}" for k, v in SMALL_RECIPE.items() if k.startswith("pretrain.")] + [
    f"pretrain.steps={STEPS}", "pretrain.checkpoint.every_n_steps=2", "pretrain.deepspeed.zero_stage=3",
]


def _curated(root: Path, n: int = 16) -> Path:
    """A curated folder (manifest + images) of rendered people, enough for pretraining."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(n):
        Image.fromarray(render_person(np.random.default_rng(i)).image).save(root / "images" / f"{i:04d}.png")
        rows.append({"id": f"{i:04d}", "path": f"images/{i:04d}.png", "status": "kept", "reason": None, "split": "train"})
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet")
    return root


def _command(curated: Path, output: Path, *launch: str) -> list[str]:
    args = ["--curated", str(curated), "--output", str(output), "--config", str(Path("params.yaml").resolve())]
    return [sys.executable, "-m", "pipelines.pretrain", *args, *(a for s in SETTINGS for a in ("--set", s)), *launch]


def _run(curated: Path, output: Path, env: dict) -> None:
    proc = subprocess.run(_command(curated, output), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """The uninterrupted single-node run: (curated folder, environment, exported backbone); its
    output folder is `<curated>/../whole`."""
    root = tmp_path_factory.mktemp("pretrain_program")
    curated = _curated(root / "curated")
    # One thread per rank in every layout, so the two-node run computes in the same order.
    env = {**os.environ, "SAPIENS2_WORKSPACE": str(root), "OMP_NUM_THREADS": "1"}
    _run(curated, root / "whole", env)
    return curated, env, load_file(root / "whole" / "backbone.safetensors")


def _assert_same_weights(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_weights(whole, tmp_path: Path) -> None:
    curated, env, weights = whole
    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen(_command(curated, interrupted), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    latest = interrupted / "checkpoints" / "latest"
    deadline = time.time() + 500
    while not latest.is_file() and time.time() < deadline:
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "backbone.safetensors").exists()

    _run(curated, interrupted, env)
    _assert_same_weights(weights, load_file(interrupted / "backbone.safetensors"))
    assert (interrupted / "mae_reconstruction.png").stat().st_size > 0


@pytest.mark.slow
def test_two_nodes_on_loopback_train_the_single_node_weights(whole, tmp_path: Path) -> None:
    """Two launcher processes, one rank each (`--nnodes 2`, node ranks 0 and 1, the Job's command),
    rendezvous at node 0 and write one run into the shared output folder."""
    curated, env, weights = whole
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    output = tmp_path / "two_nodes"
    nodes = [subprocess.Popen(_command(curated, output, "--nnodes", "2", "--node-rank", str(rank),
                                       "--master-addr", "127.0.0.1", "--master-port", port),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for rank in (0, 1)]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    _assert_same_weights(weights, load_file(output / "backbone.safetensors"))
    # Byte for byte the same folder (so the same DVC md5, the same data version), checkpoints
    # included: nothing in it records how the ranks were laid out or how fast they ran.
    assert _folder_bytes(output) == _folder_bytes(curated.parent / "whole")


def _folder_bytes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
