"""The one training loop: pretraining and all five fine-tuning tasks run through `Trainer.fit`.

A run is a DeepSpeed engine plus a `Recipe` (what a micro-batch is, what its loss is, what
happens after an optimizer step); the loop itself, the learning-rate schedule, gradient
accumulation, the per-step history, hooks (console, tracker) and resumable checkpoints are
here once. Every random draw of a micro-batch comes from `step_generator(seed, step, rank,
micro)`, so a resumed run repeats the uninterrupted one.

    for step in range(start, steps):
        set_lr -> [recipe.loss -> backward -> step] x grad_accum -> recipe.after_step
               -> history -> hooks -> checkpoint
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from sapiens2.train.checkpoint import CheckpointManager
from sapiens2.train.engine import set_lr

# hook(step, metrics): called on every rank after each optimizer step; `metrics` holds the step's
# loss terms (averaged over micro-batches), "lr" and whatever `Recipe.after_step` reported.
Hook = Callable[[int, dict[str, float]], None]


def step_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """The random stream of one micro-batch: crops, masks and sample indices depend on nothing else."""
    mixed = np.random.SeedSequence([seed, step, rank, micro]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(mixed))


class Recipe(Protocol):
    """What one kind of run trains; the engine it drives belongs to the recipe."""

    def loss(self, step: int, generator: torch.Generator) -> dict[str, torch.Tensor | float]:
        """Draw one micro-batch from `generator`, run the engine forward, return "loss" (the
        tensor to back-propagate) and any other terms or monitors to record."""

    def after_step(self, step: int) -> dict[str, float]:
        """Work after the optimizer step (EMA teacher, centre); returns scalars to log."""

    def state_dict(self) -> dict[str, Any]:
        """State outside the engine that a resumed run needs (saved with each checkpoint)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _scalar(value: torch.Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


class Trainer:
    """Runs `recipe` for a fixed number of optimizer steps under `engine`, resumable.

    `lrs[step]` is the base learning rate of each step (`set_lr` scales it per param group);
    `history` maps every loss term to its per-step values and travels in the checkpoints.
    """

    def __init__(self, engine: Any, recipe: Recipe, lrs: np.ndarray, checkpoints: CheckpointManager, seed: int,
                 grad_accum_steps: int, hooks: Sequence[Hook] = ()) -> None:
        self.engine, self.recipe, self.lrs, self.checkpoints = engine, recipe, lrs, checkpoints
        self.seed, self.grad_accum_steps, self.hooks = seed, grad_accum_steps, list(hooks)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.step = 0
        self.history: dict[str, list[float]] = {}
        self.seconds = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, **self.recipe.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = state["history"]
        self.recipe.load_state_dict(state)

    def resume(self) -> int:
        """Load the newest matching checkpoint, if any; returns the step training continues from."""
        resumed = self.checkpoints.resume(self.engine)
        if resumed is not None:
            self.step, state = resumed
            self.load_state_dict(state)
        return self.step

    def _accumulate(self, step: int) -> dict[str, float]:
        terms: dict[str, float] = {}
        for micro in range(self.grad_accum_steps):
            out = self.recipe.loss(step, step_generator(self.seed, step, self.rank, micro))
            self.engine.backward(out["loss"])
            self.engine.step()  # DeepSpeed applies the update at the accumulation boundary
            for key, value in out.items():
                terms[key] = terms.get(key, 0.0) + _scalar(value) / self.grad_accum_steps
        return terms

    def fit(self, steps: int) -> dict[str, list[float]]:
        """Train from the current step up to `steps`; returns the history."""
        started = time.perf_counter()
        for step in range(self.step, steps):
            lr = float(self.lrs[step])
            set_lr(self.engine, lr, step)
            terms = self._accumulate(step)
            for key, value in terms.items():
                self.history.setdefault(key, []).append(value)
            metrics = {**terms, "lr": lr, **self.recipe.after_step(step)}
            self.step = step + 1
            for hook in self.hooks:
                hook(step, metrics)
            if self.checkpoints.should_save(self.step):
                self.checkpoints.save(self.engine, self.step, self.state_dict())
        self.seconds += time.perf_counter() - started
        return self.history
