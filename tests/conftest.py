"""Shared fixtures: a throwaway workspace laid out like the project root."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from pipelines.common.workspace import PROJECT_ROOT

# In-process materialisations (dg.materialize) run one step at a time: each training program may
# take every core. The browser test's stack drops SAPIENS2_* and runs two at once, as deployed.
os.environ.setdefault("SAPIENS2_TRAINING_SLOTS", "1")

# A recipe small enough for a test yet running every stage for real (2 DeepSpeed ranks included).
SMALL_RECIPE = {
    "synth.n_people": 48,
    "curation.val_fraction": 0.35,
    "pretrain.arch": "sapiens2_debug",
    "pretrain.steps": 4,
    "pretrain.log_every": 2,
    "pretrain.optim.warmup_steps": 1,
    "pretrain.objective.dino_out_dim": 64,
    "pretrain.objective.dino_hidden_dim": 32,
    "pretrain.objective.dino_bottleneck_dim": 16,
    "pretrain.objective.decoder_dim": 32,
    "pretrain.objective.decoder_depth": 1,
    "pretrain.objective.decoder_heads": 2,
    "pretrain.deepspeed.micro_batch_size": 4,
    "pretrain.deepspeed.world_size": 2,
    "pretrain.checkpoint.every_n_steps": 2,
    # Dense heads beat their untrained baselines by far at 100 steps (seg mIoU 0.040 / 0.002,
    # normal 36.0 / 101.1 deg, pointmap 1.56 / 4.91 m, albedo 13.8 / 7.9 dB); pose on this tiny
    # model is erratic at short schedules (AP 0.026 at 250 steps, 0.0006 at 300, 0.023 at 400).
    "finetune.steps": 100,
    "finetune.task_steps.pose": 400,
    "finetune.task_steps.pointmap": 100,
    "finetune.log_every": 50,
    "finetune.optim.warmup_steps": 20,
    "finetune.optim.lr": 0.003,
    "finetune.deepspeed.micro_batch_size": 8,
    "evaluate.num_visualisations": 2,
    # 48 people on the debug model test the plumbing, not learning (the demo recipe and
    # benchmarks/learning.py gate against the trivial baselines): this recipe's gate is the
    # untrained head, strictly beaten.
    "evaluate.gate_baseline": "untrained_head",
    **{f"evaluate.gate_margin.{task}": 0.0 for task in ("pose", "seg", "normal", "pointmap", "albedo")},
}


@pytest.fixture
def one_thread():
    """Debug-size models are many small ops: intra-op threads only add contention on 2 cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def nested(overrides: dict) -> dict:
    out: dict = {}
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing listens on right now (all bound at once, then freed)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def make_curated(root: Path, n: int = 24) -> Path:
    """Rendered people with labels, 2/3 train and 1/3 val: a curated folder the steps read."""
    import numpy as np
    import pandas as pd
    from PIL import Image

    from sapiens2.data.synth import render_person, write_sample

    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rows = []
    for i in range(n):
        sample = render_person(np.random.default_rng(1000 + i))
        Image.fromarray(sample.image).save(root / "images" / f"{i:04d}.png")
        write_sample(root / "labels" / f"{i:04d}.npz", sample)
        rows.append({"id": f"{i:04d}", "path": f"images/{i:04d}.png", "status": "kept", "reason": None,
                     "split": "train" if i % 3 else "val"})
    pd.DataFrame(rows).to_parquet(root / "manifest.parquet")
    return root


def make_workspace(root: Path, overrides: dict | None = None) -> Path:
    """A workspace at `root`: params.yaml (project defaults + overrides), dvc.yaml, and the code
    folders the DVC stages depend on (symlinked, so hashes match the project's)."""
    root.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    (root / "params.yaml").write_text(yaml.safe_dump(merge(params, nested(overrides or {})), sort_keys=False))
    shutil.copy2(PROJECT_ROOT / "dvc.yaml", root / "dvc.yaml")
    for folder in ("sapiens2", "pipelines"):
        (root / folder).symlink_to(PROJECT_ROOT / folder, target_is_directory=True)
    return root


@pytest.fixture
def small_workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = make_workspace(tmp_path / "ws", SMALL_RECIPE)
    monkeypatch.setenv("SAPIENS2_WORKSPACE", str(root))
    monkeypatch.setenv("SAPIENS2_DVC_REMOTE", str(tmp_path / "dvc-remote"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return root
