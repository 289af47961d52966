"""How training programs are launched and how their ranks talk back.

A training step runs as `python -m pipelines.<step> ...`: that launcher process resolves and saves
the config, then starts its node's share of the `world_size` ranks through torchrun (one launcher
per node, `--nnodes/--node-rank/--master-addr`; the same command on a laptop and in the
Kubernetes Job), or runs the single rank of a one-process world itself. Rank 0 alone reports to Dagster (Pipes), to MLflow and to the console;
the other ranks only compute.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import yaml

from pipelines.common.config import PlatformConfig, load_config


# Training programs one node runs at once; dagster.yaml's `training` pool admits as many
# (tests/unit/test_training_slots.py holds the two equal). Two one-rank fine-tunings on one
# core each took 0.72-0.81x the time of the same two one after the other on both cores
# (benchmarks/training_slots.py, 2 cores): their many small ops scale poorly across threads.
DEFAULT_TRAINING_SLOTS = 2


def training_slots() -> int:
    """`$SAPIENS2_TRAINING_SLOTS`, or the default."""
    value = os.environ.get("SAPIENS2_TRAINING_SLOTS") or str(DEFAULT_TRAINING_SLOTS)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SAPIENS2_TRAINING_SLOTS={value!r}: expected a whole number >= 1")
    return int(value)


def threads_per_rank(local_ranks: int, slots: int | None = None) -> int:
    """Intra-op threads of each rank: `$OMP_NUM_THREADS` when set, else the cores split over this
    node's ranks and `slots` programs at once (default: the training slots). The CLI, `dvc repro`
    and Dagster compute the same count, and they must: a thread count changes a run's
    floating-point sums, hence its bytes."""
    chosen = os.environ.get("OMP_NUM_THREADS")
    if chosen:
        return int(chosen)
    return max(1, (os.cpu_count() or 1) // (local_ranks * (slots or training_slots())))


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block at `count` intra-op threads, then restore the caller's: a step that runs inside
    another process (a Dagster asset in its step process, a test) computes at the count its own
    process would, whatever that process had set."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Nodes:
    """This launcher's place in the job: torchrun's static rendezvous at `master_addr:master_port`,
    one launcher per node, each starting world_size / count local ranks."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def torchrun_command(module: str, local_ranks: int, args: list[str], nodes: Nodes = Nodes()) -> list[str]:
    """The command that starts this node's `local_ranks` ranks of `python -m module args`."""
    if nodes.count == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nodes.count}", f"--node_rank={nodes.rank}",
                 f"--master_addr={nodes.master_addr}", f"--master_port={nodes.master_port}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={local_ranks}",
            "-m", module, *args]


def run_ranks(module: str, world_size: int, args: list[str], nodes: Nodes = Nodes()) -> int:
    """Run this node's ranks in the foreground with this process's environment; returns the exit code.

    A world of one needs no rendezvous agent: its rank runs in this process (`module.main(args)`),
    which saves a torchrun agent and a second interpreter importing torch and DeepSpeed (about
    10 s a run here, a tenth of a demo fine-tuning). The rank sees the same arguments either way.
    """
    if world_size % nodes.count:
        raise ValueError(f"world_size {world_size} does not split evenly over {nodes.count} nodes")
    if world_size == 1:
        with intra_op_threads(threads_per_rank(1)):
            return importlib.import_module(module).main(args)
    local_ranks = world_size // nodes.count
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank(local_ranks)))
    return subprocess.run(torchrun_command(module, local_ranks, args, nodes), env=env).returncode


def save_resolved(config: dict[str, Any], path: Path) -> Path:
    """Write the resolved config; atomic, since every node's launcher writes the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, path)
    return path


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every training step shares: config, overrides, the node layout, the rank side."""
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. pretrain.steps=20")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of a multi-node job, one launcher on each")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1", help="where node 0 listens for the rendezvous")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--restart-on-mismatch", action="store_true",
                        help="a checkpoint in --output left by another recipe, dataset or world size is deleted and "
                             "training starts fresh (default: refuse to resume it); a matching one is resumed either way")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)


def resolve_config(args: argparse.Namespace) -> PlatformConfig:
    """The run's config: `--config` with the `--set` overrides, validated (once, in the launcher)."""
    return load_config(args.config, parse_overrides(args.set))


def launch_ranks(module: str, args: argparse.Namespace, config: PlatformConfig, world_size: int,
                 worker_args: list[str]) -> int:
    """The launcher half of a training step (CLI, Dagster Pipes, DVC and the Kubernetes Job alike):
    write the resolved `config` to `<output>/config.yaml` and start this node's ranks with
    `worker_args` and `--rank-worker`; the ranks read that file and nothing else."""
    resolved = save_resolved(config.to_dict(), args.output / "config.yaml")
    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    rank_args = [*worker_args, "--output", str(args.output), "--config", str(resolved), "--rank-worker",
                 *(["--restart-on-mismatch"] if args.restart_on_mismatch else [])]
    return run_ranks(module, world_size, rank_args, nodes)


def compute_tags() -> dict[str, str]:
    """What sets a run's float rounding besides its code and inputs: the kernel set torch chose
    for this process from the features the CPU reports (`ATEN_CPU_CAPABILITY` overrides it) and
    the intra-op threads. Two launches that differ in either differ in the last bits of every
    loss: a step-0 loss that two launches of one fine-tune gave 1 ulp apart was, to the bit, the
    one AVX2 kernels give on this AVX-512 machine (README, known limits)."""
    import torch

    return {"compute.cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "compute.threads": str(torch.get_num_threads())}


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

    def started(self, compute: dict[str, str]) -> None:
        """Say what the run computes with (`compute_tags`) and where a resumed run picks up (once,
        before its first step)."""
        if not self.enabled:
            return
        lines = [f"[{self.name}] {compute['compute.cpu_kernels']} kernels, {compute['compute.threads']} threads"]
        if self.start_step > 0:
            lines.append(f"[{self.name}] resumed from step {self.start_step}/{self.total}")
        for line in lines:
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
        """A `Trainer` hook printing `keys` of the metrics (all if None; those the step has) every
        `n`-th and the last step."""
        def hook(step: int, metrics: dict[str, float]) -> None:
            if (step + 1) % n == 0 or step + 1 == self.total:
                self(step, metrics if keys is None else {k: metrics[k] for k in keys if k in metrics})
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
