"""Training config sections, the DeepSpeed JSON generated from them, and the step schedules."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from sapiens2.train.config import CheckpointSection, DeepSpeedSection, OptimSection
from sapiens2.train.schedules import cosine_momentum, lr_schedule, warmup_cosine, warmup_linear_decay


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        (DeepSpeedSection, "zero_stage", 4),
        (DeepSpeedSection, "micro_batch_size", 0),
        (DeepSpeedSection, "grad_accum_steps", -1),
        (DeepSpeedSection, "grad_clip", 0.0),
        (DeepSpeedSection, "world_size", 0),
        (OptimSection, "lr", -1e-3),
        (OptimSection, "warmup_steps", -5),
        (OptimSection, "min_lr_ratio", 1.5),
        (OptimSection, "layer_decay", 0.0),
        (OptimSection, "betas", (0.9, 1.0)),
        (OptimSection, "schedule", "step"),
        (CheckpointSection, "every_n_steps", -1),
        (CheckpointSection, "keep_last", 0),
    ],
)
def test_invalid_value_is_refused_naming_the_field(section, field, value) -> None:
    with pytest.raises(ValidationError) as err:
        section(**{field: value})
    assert [e["loc"] for e in err.value.errors()] == [(field,)]
    assert field in str(err.value)


def test_sections_are_frozen_and_reject_unknown_fields() -> None:
    ds = DeepSpeedSection()
    with pytest.raises(ValidationError):
        ds.zero_stage = 3
    with pytest.raises(ValidationError, match="zero_stge"):
        DeepSpeedSection(zero_stge=3)


def test_defaults_follow_the_finetuning_recipe() -> None:
    optim = OptimSection()
    assert (optim.lr, optim.betas, optim.weight_decay, optim.warmup_steps) == (5e-4, (0.9, 0.999), 0.1, 500)
    assert optim.schedule == "linear" and optim.min_lr_ratio == 0.0
    ds = DeepSpeedSection()
    assert ds.bf16 and 2.0 <= ds.grad_clip <= 4.0


def test_deepspeed_json_is_generated_from_the_sections() -> None:
    from sapiens2.train.engine import build_deepspeed_config

    ds = DeepSpeedSection(zero_stage=3, bf16=True, micro_batch_size=4, grad_accum_steps=2, grad_clip=2.5, world_size=8)
    optim = OptimSection(lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-6)
    config = build_deepspeed_config(ds, optim)
    assert config["train_batch_size"] == 64 == ds.global_batch_size
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 2.5
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"] == {"stage": 3}
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.05, "torch_adam": True},
    }
    assert "scheduler" not in config  # our per-step lr array drives the lr
    assert json.loads(json.dumps(config)) == config


def test_warmup_linear_decay_matches_the_recipe_shape() -> None:
    lr = warmup_linear_decay(5e-4, total_steps=1000, warmup_steps=500)
    assert lr.shape == (1000,)
    assert lr[0] == pytest.approx(5e-7)  # warmup starts at 1e-3 x
    assert lr[500] == pytest.approx(5e-4) and lr.max() == pytest.approx(5e-4)
    assert np.all(np.diff(lr[:501]) > 0) and np.all(np.diff(lr[500:]) < 0)
    assert lr[-1] == 0.0
    assert np.allclose(np.diff(lr[500:]), np.diff(lr[500:])[0])  # linear


def test_warmup_cosine_ends_at_min_ratio() -> None:
    lr = warmup_cosine(1.0, total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert lr[10] == pytest.approx(1.0) and lr[-1] == pytest.approx(0.1)
    assert lr[55] == pytest.approx(0.55, abs=0.01)  # half way down the cosine
    assert np.all(np.diff(lr[10:]) <= 0)


def test_cosine_momentum_rises_from_start_to_end() -> None:
    m = cosine_momentum(0.992, 1.0, 50)
    assert m[0] == pytest.approx(0.992) and m[-1] == pytest.approx(1.0)
    assert np.all(np.diff(m) >= 0)


def test_lr_schedule_follows_the_section() -> None:
    optim = OptimSection(lr=2e-3, warmup_steps=5, min_lr_ratio=0.25, schedule="cosine")
    assert np.array_equal(lr_schedule(optim, 40), warmup_cosine(2e-3, 40, 5, 0.25))
    assert np.array_equal(lr_schedule(optim.model_copy(update={"schedule": "linear"}), 40),
                          warmup_linear_decay(2e-3, 40, 5, 0.25))


@pytest.mark.parametrize(("total", "warmup"), [(0, 0), (10, 11), (10, -1)])
def test_schedule_lengths_are_checked(total: int, warmup: int) -> None:
    with pytest.raises(ValueError, match="steps"):
        warmup_linear_decay(1.0, total, warmup)


def test_checkpoint_manager_cadence_and_latest_tag(tmp_path) -> None:
    from sapiens2.train.checkpoint import CheckpointManager

    manager = CheckpointManager.from_section(tmp_path, CheckpointSection(every_n_steps=250, keep_last=2))
    assert [s for s in range(0, 1001) if manager.should_save(s)] == [250, 500, 750, 1000]
    assert manager.latest_step() is None
    (tmp_path / "step_00000750").mkdir()
    (tmp_path / "latest").write_text("step_00000750")
    assert manager.latest_step() == 750
    # A pointer naming no tag (DeepSpeed's own naming here) is no checkpoint: with no complete
    # tag to fall back to (tests/unit/test_checkpoint_manager.py), the run starts fresh.
    (tmp_path / "latest").write_text("global_step750")
    assert manager.latest_step() is None


def test_only_stale_torch_extension_build_locks_are_removed(tmp_path, monkeypatch) -> None:
    import os
    import time

    from sapiens2.train.engine import clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "py311_cpu" / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    assert clear_stale_build_locks(max_age_s=600) == [stale]
    assert not stale.exists() and fresh.exists()
