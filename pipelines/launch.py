"""How training programs are launched and how their ranks talk back.

A training step runs as `python -m pipelines.<step> ...`: that launcher process resolves and saves
the config, then starts `world_size` ranks through torchrun, or runs the single rank of a
one-process world itself. Rank 0 alone reports to Dagster (Pipes), to MLflow and to the console;
the other ranks only compute.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml


def torchrun_command(module: str, world_size: int, args: list[str]) -> list[str]:
    """The command that starts `world_size` local ranks of `python -m module args`."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={world_size}",
        "-m", module, *args,
    ]


def run_ranks(module: str, world_size: int, args: list[str]) -> int:
    """Run the ranks in the foreground with this process's environment; returns the exit code.

    A world of one needs no rendezvous agent: its rank runs in this process (`module.main(args)`),
    which saves a torchrun agent and a second interpreter importing torch and DeepSpeed (about
    10 s a run here, a tenth of a demo fine-tuning). The rank sees the same arguments either way.
    """
    if world_size == 1:
        return importlib.import_module(module).main(args)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world_size)))
    return subprocess.run(torchrun_command(module, world_size, args), env=env).returncode


def save_resolved(config: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class _Silent:
    """Stands in for the Pipes context on ranks other than 0 and outside Dagster."""

    class _Log:
        def info(self, msg: str) -> None:  # noqa: D102 - same signature as PipesContext.log
            pass

        warning = info

    log = _Log()

    def report_asset_materialization(self, **_: Any) -> None:
        pass

    def report_custom_message(self, payload: Any) -> None:
        pass


@contextlib.contextmanager
def rank_zero_pipes(rank: int) -> Iterator[Any]:
    """Dagster Pipes on rank 0 when launched by Dagster; a silent stand-in everywhere else."""
    if rank != 0 or "DAGSTER_PIPES_CONTEXT" not in os.environ:
        yield _Silent()
        return
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        yield pipes


class StepLogger:
    """Per-step progress lines on rank 0: step, losses, learning rate, speed and ETA."""

    def __init__(self, name: str, total_steps: int, start_step: int, pipes: Any, enabled: bool) -> None:
        self.name, self.total, self.pipes, self.enabled = name, total_steps, pipes, enabled
        self.start_step, self.start_time = start_step, time.perf_counter()

    def resumed(self) -> None:
        """Say where a resumed run picks up (once, before its first step)."""
        if self.enabled and self.start_step > 0:
            line = f"[{self.name}] resumed from step {self.start_step}/{self.total}"
            print(line, flush=True)
            self.pipes.log.info(line)

    def __call__(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = step + 1 - self.start_step
        elapsed = time.perf_counter() - self.start_time
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step - 1) / rate if rate > 0 else 0.0
        parts = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        line = f"[{self.name}] step {step + 1}/{self.total} {parts} | {rate:.2f} it/s eta {eta:.0f}s"
        print(line, flush=True)
        self.pipes.log.info(line)

    def every(self, n: int, keys: tuple[str, ...] | None = None) -> Callable[[int, dict[str, float]], None]:
        """A `Trainer` hook printing `keys` of the metrics (all if None) every `n`-th and the last step."""
        def hook(step: int, metrics: dict[str, float]) -> None:
            if (step + 1) % n == 0 or step + 1 == self.total:
                self(step, metrics if keys is None else {k: metrics[k] for k in keys})
        return hook


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["pretrain.steps=20", "finetune.init_checkpoint=null"]` -> dotted keys with YAML-typed values."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides
