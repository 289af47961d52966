"""torchrun worker for test_deepspeed_engine.py: trains a toy backbone + head through the platform's
one loop (`sapiens2.train.trainer.Trainer`) under ZeRO 1/2/3 in bf16 and writes what the test
checks under --out (rank 0 only).

Phases, run in the order given (several per launch: starting DeepSpeed is the slow part):
  full    per stage: export at step 0, train 8 steps (checkpoint every 4, keep 1), export.
  crash   per stage: train from scratch, checkpoint at step 4, keep going to step 6 and drop
          the run, so steps 5-6 are lost; in the last stage of the launch every rank
          SIGKILLs itself there instead of returning.
  resume  per stage: build the model from a different init seed, resume from the crash
          checkpoints, train to step 8, export.
  single  (plain `python`, no torchrun) per stage: train 4 steps on one rank; check that a
          config whose world_size differs from the job's is refused.
Batches are a pure function of (seed, step, rank, micro step) (`step_generator`), so no RNG state
is checkpointed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sapiens2.train.checkpoint import CheckpointManager, export_full_state_dict, full_fp32_parameters
from sapiens2.train.config import DeepSpeedSection, OptimSection
from sapiens2.train.engine import autocast_inputs, init_distributed, initialize
from sapiens2.train.lr_decay import layerwise_param_groups
from sapiens2.train.schedules import lr_schedule
from sapiens2.train.trainer import Trainer

IN, DIM, OUT, DEPTH = 8, 384, 4, 2  # DIM*DIM > 1e5 so ZeRO-3 really partitions the block weights
TOTAL_STEPS, CKPT_EVERY, CRASH_AFTER = 8, 4, 6
DATA_SEED = 1234
OPTIM = OptimSection(lr=3e-3, weight_decay=0.05, warmup_steps=1, min_lr_ratio=0.1, layer_decay=0.5)


class ToyBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.register_buffer("in_scale", torch.linspace(0.5, 1.5, IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # DeepSpeed leaves buffers in fp32 under bf16: cast to the activation dtype.
        x = self.embed(x * self.in_scale.to(x.dtype))
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = ToyBackbone()
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)  # not optimized, still partitioned
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.backbone(x)
        return self.head(x + self.frozen(x))


def layer_id(name: str) -> int:
    if name.startswith("embed."):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return DEPTH + 1


class ToyRecipe:
    """Regress a fixed random map: the `Recipe` contract at its smallest (no state outside the engine)."""

    def __init__(self, engine, batch_size: int) -> None:
        self.engine, self.batch = engine, batch_size
        self.target_map = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(DATA_SEED))

    def loss(self, step: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        x = torch.randn(self.batch, IN, generator=generator)
        y = torch.tanh(x @ self.target_map).to(self.engine.device)
        return {"loss": F.mse_loss(self.engine(autocast_inputs(self.engine, x)).float(), y)}

    def after_step(self, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def train(stage: int, init_seed: int, root: Path, resume: bool, stop_after: int, kill: bool) -> dict:
    """One run; returns what rank 0 reports. The group holding the final norm and head bias
    gets lr_scale 0 so the test can see per-group lrs reach the ZeRO optimizer."""
    ds = DeepSpeedSection(zero_stage=stage, bf16=True, micro_batch_size=16, grad_accum_steps=2,
                          grad_clip=1.0, world_size=dist.get_world_size())
    torch.manual_seed(init_seed)
    model = ToyModel()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    groups = layerwise_param_groups(model, OPTIM.lr, OPTIM.weight_decay, OPTIM.layer_decay, DEPTH, layer_id)
    probe = next(g for g in groups if g["lr_scale"] == 1.0 and g["weight_decay"] == 0.0)
    probe["lr_scale"] = 0.0
    probe_names = [n for n, p in model.named_parameters() if any(p is q for q in probe["params"])]
    scales = {n: g["lr_scale"] for g in groups for n, p in model.named_parameters() if any(p is q for q in g["params"])}

    engine = initialize(model, groups, ds, OPTIM)
    manager = CheckpointManager(root, CKPT_EVERY, keep_last=1)
    report: dict = {"probe_names": probe_names, "lr_scales": scales, "frozen": frozen}
    if not resume:
        report["export_step0"] = export_full_state_dict(engine)
        report["init"] = init

    def record_lrs(step: int, metrics: dict) -> None:
        report["group_lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
        if kill and step + 1 == CRASH_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(engine, ToyRecipe(engine, ds.micro_batch_size), lr_schedule(OPTIM, TOTAL_STEPS), manager,
                      DATA_SEED, ds.grad_accum_steps, hooks=[record_lrs])
    if resume:
        report["resumed_step"] = trainer.resume()
        report["resumed_client_state"] = json.loads(json.dumps(trainer.state_dict()))
    report["losses"] = trainer.fit(stop_after)["loss"]
    report["export"] = export_full_state_dict(engine)
    params = dict(full_fp32_parameters(engine))
    full_here = torch.tensor(int({n: p.shape for n, p in params.items()} == shapes), device=engine.device)
    dist.all_reduce(full_here, op=dist.ReduceOp.MIN)
    report["fp32_params_full_on_all_ranks"] = bool(full_here)
    if dist.get_rank() == 0:
        report["fp32_params_equal_export"] = all(torch.equal(p.cpu(), report["export"][n]) for n, p in params.items())
    return report


def _world_size_mismatch_error() -> str:
    ds = DeepSpeedSection(zero_stage=1, world_size=dist.get_world_size() + 1)
    try:
        initialize(ToyModel(), [{"params": [], "lr_scale": 1.0}], ds, OPTIM)
    except ValueError as err:
        return str(err)
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phases", choices=["full", "crash", "resume", "single"], nargs="+", required=True)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    init_distributed()
    for phase in args.phases:
        for stage in args.stages:
            root = args.out / f"zero{stage}"
            if phase == "full":
                report = train(stage, 0, root / "full", resume=False, stop_after=TOTAL_STEPS, kill=False)
            elif phase == "crash":
                last = (phase, stage) == (args.phases[-1], args.stages[-1])
                report = train(stage, 0, root / "crash", resume=False, stop_after=CRASH_AFTER, kill=last)
            elif phase == "resume":
                report = train(stage, 1, root / "crash", resume=True, stop_after=TOTAL_STEPS, kill=False)
            else:
                report = train(stage, 0, root / "single", resume=False, stop_after=CKPT_EVERY, kill=False)
                report["mismatch_error"] = _world_size_mismatch_error()
            if dist.get_rank() == 0:
                root.mkdir(parents=True, exist_ok=True)
                torch.save(report, root / f"{phase}.pt")


if __name__ == "__main__":
    main()
