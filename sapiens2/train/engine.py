"""The one place a plain `nn.Module` becomes a DeepSpeed ZeRO engine.

The DeepSpeed JSON is generated from the typed sections, never written by hand. The learning
rate is driven by our own per-step array (`schedules.lr_schedule`) through `set_lr`, so no
DeepSpeed scheduler is configured and resuming needs no scheduler state.

On a machine without CUDA, DeepSpeed runs on its CPU accelerator with the gloo backend; the
optimizer is torch's AdamW (`torch_adam`) because no DeepSpeed CPU Adam op is built.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_set_full_fp32_param
from torch import nn
from torch.utils.cpp_extension import get_default_build_root

from sapiens2.train.config import DeepSpeedSection, OptimSection
from sapiens2.train.lr_decay import apply_lr

log = logging.getLogger(__name__)
# A JIT op build (DeepSpeed's shm comm op on CPU) takes about a minute; a lock file older than
# this belongs to a build whose process was killed, and torch would wait on it forever.
STALE_BUILD_LOCK_S = 600

# DeepSpeed prints a throughput line every `steps_per_print` steps; our loop does its own logging.
_NEVER = 2**31 - 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clear_stale_build_locks(max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove torch extension build locks older than `max_age_s`; returns the removed paths.

    torch's FileBaton waits without a timeout for the `lock` file of a JIT build; a process
    killed mid-build leaves it behind and every later DeepSpeed start hangs in `init_distributed`.
    """
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed = []
    for lock in root.glob("**/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                removed.append(lock)
                log.warning("removed stale torch extension build lock %s (%.0f s old)", lock, age)
        except FileNotFoundError:
            continue  # another rank removed it or the build finished
    return removed


def init_distributed() -> tuple[int, int]:
    """Join (or create) the default process group and return (rank, world_size).

    Under torchrun the rendezvous comes from its environment variables; a plain single process
    gets rank 0 of a world of 1 on a free local port. Backend: nccl with CUDA, gloo otherwise.
    """
    # Everything imported and built so far lives for the whole run: moved out of the cyclic
    # collector's view, its generation-2 scans stop costing ~12 % of a small CPU step (measured
    # on a tiny fine-tuning after the launcher's imports).
    gc.freeze()
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
            for key, value in single.items():
                os.environ.setdefault(key, value)
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if torch.cuda.is_available():
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        clear_stale_build_locks()
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def build_deepspeed_config(ds: DeepSpeedSection, optim: OptimSection) -> dict:
    """The DeepSpeed JSON for these sections (saved with every run as the resolved config)."""
    return {
        "train_batch_size": ds.global_batch_size,
        "train_micro_batch_size_per_gpu": ds.micro_batch_size,
        "gradient_accumulation_steps": ds.grad_accum_steps,
        "gradient_clipping": ds.grad_clip,
        "bf16": {"enabled": ds.bf16},
        "zero_optimization": {"stage": ds.zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "eps": optim.eps,
                "weight_decay": optim.weight_decay,
                "torch_adam": True,
            },
        },
        "steps_per_print": _NEVER,
    }


def initialize(
    model: nn.Module, param_groups: list[dict], ds: DeepSpeedSection, optim: OptimSection
) -> deepspeed.DeepSpeedEngine:
    """Wrap `model` in a DeepSpeed engine optimizing `param_groups` (each with an `lr_scale`).

    Under bf16 the engine casts the module's parameters (not its buffers) to bfloat16; feed it
    inputs through `autocast_inputs`. The optimizer's fp32 master weights keep the full-precision
    values the model had (DeepSpeed alone would start them from the bf16-rounded copies).
    """
    _, world_size = init_distributed()
    if world_size != ds.world_size:
        raise ValueError(f"world_size is {ds.world_size} in the config but the job runs {world_size} ranks")
    groups = [group for group in param_groups if group["params"]]
    # DeepSpeed builds the fp32 master weights from the bf16-cast parameters, which would round
    # pretrained weights to bf16; keep the fp32 tensors (references, not copies) to restore them.
    optimized = {id(p) for group in groups for p in group["params"]}
    fp32 = {name: p.data for name, p in model.named_parameters() if id(p) in optimized} if ds.bf16 else {}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=build_deepspeed_config(ds, optim))
    for name, param in engine.module.named_parameters():
        if name in fp32:
            safe_set_full_fp32_param(param, fp32[name].to(engine.device))
    return engine


def set_lr(engine: deepspeed.DeepSpeedEngine, lr: float, step: int | None = None) -> None:
    """`apply_lr` on the engine's optimizer groups."""
    apply_lr(engine.optimizer.param_groups, lr, step)


def autocast_inputs(engine: deepspeed.DeepSpeedEngine, tensor: torch.Tensor) -> torch.Tensor:
    """Move a model input to the engine's device and, if floating point, to its parameter dtype
    (bf16 under mixed precision: the engine runs no autocast, so fp32 inputs would not match)."""
    tensor = tensor.to(engine.device)
    if tensor.is_floating_point() and engine.bfloat16_enabled():
        tensor = tensor.to(torch.bfloat16)
    return tensor
