"""`finetune.optim.backbone_frozen_fraction` (LP-FT): the backbone keeps its weights for the first
share of a fine-tune while the head trains, then both train."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from pipelines.common.config import load_config
from pipelines.common.task_models import SCRATCH, finetune_param_groups, initial_model
from sapiens2.train.config import FinetuneOptimSection
from sapiens2.train.engine import set_lr

pytestmark = pytest.mark.usefixtures("one_thread")


CONFIG = load_config(None, {"pretrain.arch": "sapiens2_debug"})


def optim(fraction: float) -> FinetuneOptimSection:
    """The default fine-tuning optimizer section with the backbone frozen for `fraction` of a run."""
    return FinetuneOptimSection.model_validate(
        {**CONFIG.finetune.optim.model_dump(), "backbone_frozen_fraction": fraction})


def test_frozen_steps_are_a_share_of_each_tasks_run() -> None:
    assert optim(0.2).backbone_frozen_steps(450) == 90
    assert optim(0.2).backbone_frozen_steps(70) == 14
    assert optim(0.0).backbone_frozen_steps(600) == 0
    with pytest.raises(ValidationError, match="backbone_frozen_fraction"):
        optim(1.0)


def test_only_backbone_groups_are_frozen_and_keep_their_lr_scales_and_weight_decay() -> None:
    model = initial_model(CONFIG, "seg", SCRATCH)
    groups = finetune_param_groups(model, optim(0.5), steps=8)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in groups:
        in_backbone = {names[id(p)].startswith("backbone.") for p in group["params"]}
        assert len(in_backbone) == 1, "a group mixes backbone and head parameters"
        assert group["frozen_until"] == (4 if in_backbone.pop() else 0)
    assert sum(len(g["params"]) for g in groups) == len(names)
    unfrozen = finetune_param_groups(model, optim(0.0), steps=8)

    def settings(of: list[dict]) -> dict[str, tuple[float, float]]:
        return {names[id(p)]: (g["lr_scale"], g["weight_decay"]) for g in of for p in g["params"]}

    # The same lr scales and weight decays as without the freeze: it changes only when a group trains.
    assert settings(groups) == settings(unfrozen)
    assert {decay for _, decay in settings(groups).values()} == {0.0, CONFIG.finetune.optim.weight_decay}


def test_backbone_moves_only_after_its_frozen_steps() -> None:
    model = initial_model(CONFIG, "pose", SCRATCH)
    groups = finetune_param_groups(model, optim(0.5), steps=4)
    optimizer = torch.optim.AdamW(groups)
    engine = SimpleNamespace(optimizer=optimizer)
    image = torch.randn(2, 3, *CONFIG.image_size)

    def snapshot(prefix: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(prefix)}

    def moved(before: dict[str, torch.Tensor]) -> bool:
        now = dict(model.named_parameters())
        return any(not torch.equal(now[n], value) for n, value in before.items())

    backbone, head = snapshot("backbone."), snapshot("head.")
    for step in range(4):
        if step == 2:
            assert not moved(backbone) and moved(head)
        set_lr(engine, 1e-2, step)
        optimizer.zero_grad()
        output = model(image)
        loss = sum(t.float().pow(2).mean() for t in (output.values() if isinstance(output, dict) else [output]))
        loss.backward()
        optimizer.step()
    assert moved(backbone)
