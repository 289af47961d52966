"""Training throughput on one accelerator: pretraining and fine-tuning steps under DeepSpeed ZeRO-2.

Per run: images/s, median step time, peak GPU memory, model TFLOP/s and MFU, plus ratios between
runs of one invocation (a noisy machine slows them alike). The platform's own objects run:
`PretrainRecipe` / `FinetuneRecipe` in the `Trainer` loop on `initialize`d engines (world size 1;
`init_distributed` sets RANK, WORLD_SIZE, MASTER_ADDR/PORT when absent; NCCL on CUDA, gloo on CPU),
configured by a `PlatformConfig` with the library defaults (the paper's objective, not params.yaml).
Only the data is synthetic: rendered people in memory; host-side batch making is timed inside the
step, as the recipes do it. By hand on a GPU machine, never in CI (`PYTHONPATH=.` if not installed):

    python benchmarks/gpu.py > gpu.json    # 0.4b pretrain + seg fine-tune, 1b seg fine-tune

JSON to stdout, progress to stderr; a failed run (out of memory, say) is recorded with its error,
the others still run, and the exit status is 1. tests/unit/test_gpu_benchmark.py smoke-runs it on CPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import yaml

from pipelines.common.config import load_config
from pipelines.common.task_models import SCRATCH, finetune_param_groups, initial_model
from sapiens2.data.augment import Augment, person_crop
from sapiens2.data.dataset import COMMON_FIELDS, TASK_FIELDS, CuratedDataset, resize_sample
from sapiens2.data.synth import render_person
from sapiens2.model import build_backbone
from sapiens2.pretrain.meta_arch import PretrainStudent
from sapiens2.pretrain.teacher import build_teacher
from sapiens2.pretrain.recipe import PretrainRecipe
from sapiens2.pretrain.schedules import pretrain_param_groups
from sapiens2.tasks import TASK_NAMES
from sapiens2.tasks.recipe import FinetuneRecipe
from sapiens2.train.checkpoint import CheckpointManager
from sapiens2.train.engine import init_distributed, initialize
from sapiens2.train.trainer import Trainer

# Backbone forward cost at 1024x768 in GMACs: /work/shared/reference/SAPIENS2_FACTS.md, section 1,
# column "GFLOPs-MAC @1024x768 (reference)". 1 MAC = 2 FLOPs.
REFERENCE_GMACS_1024x768 = {"sapiens2_0.1b": 342, "sapiens2_0.4b": 1260, "sapiens2_0.8b": 2592,
                            "sapiens2_1b": 4715, "sapiens2_5b": 15722}
# Dense bf16 tensor-core peak of an H100 / H200 SXM (no sparsity): the default MFU denominator.
H100_H200_BF16_DENSE_TFLOPS = 989.0
RENDERED_PEOPLE = 8


def model_flops_per_image(arch: str, image_size: tuple[int, int], objective=None) -> float | None:
    """Backbone FLOPs of one training image: the reference forward scaled linearly in pixels (tokens;
    attention's quadratic term makes it a slight overestimate below 1024x768), x3 for a trained pass
    (forward + backward ~2x). Pretraining, per source image: the student's 2 global crops at their
    visible tokens and `n_local` half-side crops (1/4 of the tokens), trained, plus the EMA teacher's
    2 full global crops, forward only. Task heads, DINO / iBOT heads and the MAE decoder: not counted."""
    gmacs = REFERENCE_GMACS_1024x768.get(arch)
    if gmacs is None:
        return None
    forward = 2e9 * gmacs * image_size[0] * image_size[1] / (1024 * 768)
    if objective is None:  # fine-tuning
        return 3 * forward
    return forward * (2 * (1 - objective.mask_ratio) * 3 + objective.n_local * 0.25 * 3 + 2 * 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--archs", default="sapiens2_0.4b,sapiens2_1b", help="comma-separated; each fine-tunes")
    parser.add_argument("--pretrain-archs", default="sapiens2_0.4b", help="those of --archs that also pretrain")
    parser.add_argument("--tasks", default="seg", help="comma-separated fine-tuning tasks, or 'all'")
    parser.add_argument("--image-size", type=int, nargs=2, default=(1024, 768), metavar=("H", "W"))
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, kernel choice)")
    parser.add_argument("--micro-batch", type=int, default=4, help="images per step (one rank, no accumulation)")
    parser.add_argument("--peak-tflops", type=float, help=f"MFU denominator ({H100_H200_BF16_DENSE_TFLOPS:g} on cuda)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, help="default: on for cuda, off for cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="PlatformConfig override (YAML value), e.g. pretrain.objective.dino_out_dim=1024")
    args = parser.parse_args(argv)
    args.bf16 = args.device == "cuda" if args.bf16 is None else args.bf16
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = H100_H200_BF16_DENSE_TFLOPS
    if (args.device == "cuda") != torch.cuda.is_available():  # DeepSpeed and `init_distributed` follow CUDA
        parser.error(f"--device {args.device}, but torch {torch.__version__} sees {torch.cuda.device_count()} GPUs"
                     + (" (hide them with CUDA_VISIBLE_DEVICES= for a cpu run)" if args.device == "cpu" else ""))
    return args


def platform_config(args: argparse.Namespace, arch: str, total_steps: int):
    # No lr warmup (`step_trainer` holds the lr constant): lr values do not change what a step costs.
    deepspeed = {"zero_stage": 2, "bf16": args.bf16, "micro_batch_size": args.micro_batch, "world_size": 1}
    section = {"steps": total_steps, "optim.warmup_steps": 0, "deepspeed": deepspeed}
    overrides = {"image_size": list(args.image_size), "keypoint_set": "sapiens308", "pretrain.arch": arch,
                 **{f"{stage}.{key}": value for stage in ("pretrain", "finetune") for key, value in section.items()}}
    overrides |= {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in args.set)}
    return load_config(None, overrides)


class InMemoryLabelledData(CuratedDataset):
    """A `CuratedDataset` with its decode cache filled from memory (no files): its own `__getitem__`
    (copy, augment with the rng of (seed, epoch, index)) serves `FinetuneRecipe`, all cache hits."""

    def __init__(self, samples: list[dict], augment: Augment, seed: int) -> None:  # not super()'s: it reads a manifest
        self.ids, self._decoded = [s["id"] for s in samples], dict(enumerate(samples))
        self.augment, self.seed, self.epoch = augment, seed, 0


def rendered_people(config) -> list[dict]:
    """Synthetic people with every label, rendered small and resized as the dataset resizes one."""
    people = (render_person(np.random.default_rng(i), keypoint_set=config.keypoint_set) for i in range(RENDERED_PEOPLE))
    return [resize_sample({"id": f"synthetic-{i}", **vars(p)}, *config.image_size) for i, p in enumerate(people)]


def step_trainer(model, groups: list[dict], section, optim, recipe_for, total_steps: int) -> Trainer:
    """The step's engine (`initialize` on the step's own optimizer groups) and a `Trainer` on
    `section`'s recipe that never checkpoints, at a constant lr: lr values do not change what a step costs."""
    engine = initialize(model, groups, section.deepspeed, optim)
    never = CheckpointManager(os.devnull, every_n_steps=total_steps + 1, keep_last=1)
    return Trainer(engine, recipe_for(engine), np.full(total_steps, optim.lr), never, section.seed, grad_accum_steps=1)


def pretrain_trainer(config, people: list[dict], total_steps: int) -> Trainer:
    """What `pipelines.pretrain.train` builds, minus curated images, tracking and outputs."""
    cfg = config.pretrain
    obj, images = cfg.objective, np.stack([p["image"] for p in people])
    # pipelines.pretrain.build_student, inlined: that step module imports MLflow, absent on a bare GPU box.
    torch.manual_seed(cfg.seed)
    student = PretrainStudent(build_backbone(cfg.arch, img_size=config.image_size), obj)
    teacher = build_teacher(student)
    groups = pretrain_param_groups(student, cfg.optim, obj, total_steps)
    return step_trainer(student, groups, cfg, cfg.optim, lambda engine: PretrainRecipe(
        engine, teacher, obj, images, config.image_size, cfg.deepspeed.micro_batch_size, total_steps), total_steps)


def finetune_trainer(config, task_name: str, people: list[dict], total_steps: int) -> Trainer:
    """What `pipelines.finetune.train` builds from a scratch backbone, minus the dataset on disk."""
    cfg, task = config.finetune, config.task(task_name)
    flip_pairs = tuple(config.dataset_keypoints()["flip_pairs"])
    augment = cfg.augmentation(flip_pairs) or Augment(hflip_prob=0.5, flip_pairs=flip_pairs)  # the dataset's default
    samples = [{f: p[f] for f in ("id", "image", *COMMON_FIELDS, *TASK_FIELDS[task_name])} for p in people]
    if task.person_crop_padding is not None:
        samples = [person_crop(s, task.person_crop_padding) for s in samples]
    model, optim = initial_model(config, task_name, SCRATCH), cfg.optim_for(task_name)
    groups = finetune_param_groups(model, optim, total_steps)
    return step_trainer(model, groups, cfg, optim, lambda engine: FinetuneRecipe(
        engine, task, InMemoryLabelledData(samples, augment, cfg.seed), cfg.deepspeed.micro_batch_size), total_steps)


def release_memory() -> None:
    """`init_distributed` gc.freeze()s all that is alive at each `initialize`, the run's engine and
    model included; unfreeze, or their reference cycles (and GPU memory) are never collected."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def benchmark(args: argparse.Namespace, arch: str, phase: str, people: list[dict]) -> dict:
    total, cuda = args.warmup + args.steps, torch.cuda.is_available()
    config = platform_config(args, arch, total)
    record = {"arch": arch, "phase": phase, "image_size": list(args.image_size), "micro_batch": args.micro_batch,
              "warmup_steps": args.warmup, "steps_timed": args.steps,  # and what earlier runs left allocated:
              "allocated_gib_at_start": round(torch.cuda.memory_allocated() / 2**30, 3) if cuda else None}
    if phase == "pretrain":
        trainer = pretrain_trainer(config, people, total)
        per_image = model_flops_per_image(arch, args.image_size, config.pretrain.objective)
        record["teacher_dtype"] = str(next(trainer.recipe.teacher.parameters()).dtype)  # not the engine's
    else:
        trainer = finetune_trainer(config, phase.split(":", 1)[1], people, total)
        per_image = model_flops_per_image(arch, args.image_size)
    try:
        trainer.fit(args.warmup)
        times = []
        for step in range(args.warmup, total):  # one step per fit, each timed to its end on the device
            start = time.perf_counter()
            trainer.fit(step + 1)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    finally:
        trainer.engine.destroy()
    step_s = float(np.median(times))
    tflops = per_image * args.micro_batch / step_s / 1e12 if per_image else None
    return {**record, "step_time_s": round(step_s, 4), "step_times_s": [round(t, 4) for t in times],
            "images_per_s": round(args.micro_batch / step_s, 3),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
            "model_tflop_per_image": round(per_image / 1e12, 4) if per_image else None,
            "achieved_tflops": round(tflops, 3) if tflops else None,
            "mfu": round(tflops / args.peak_tflops, 4) if tflops and args.peak_tflops else None}


def ratios(runs: list[dict]) -> list[dict]:
    """Images/s ratios within this invocation, beside the ratio equal MFU would give (from FLOPs):
    each fine-tune against its arch's pretraining, each arch against the first arch of that phase."""
    done, flops = [r for r in runs if "images_per_s" in r], "model_tflop_per_image"
    first = {r["phase"]: r for r in reversed(done)}  # the first run of each phase
    pairs = [(f"{r['arch']}: {r['phase']} / pretrain", r, p) for r in done for p in done
             if p["arch"] == r["arch"] and p["phase"] == "pretrain" != r["phase"]]
    pairs += [(f"{r['phase']}: {r['arch']} / {first[r['phase']]['arch']}", r, first[r["phase"]])
              for r in done if first[r["phase"]] is not r]
    return [{"what": what, "images_per_s_ratio": round(num["images_per_s"] / den["images_per_s"], 4),
             "if_equal_mfu": round(den[flops] / num[flops], 4) if num[flops] and den[flops] else None}
            for what, num, den in pairs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Stdout carries the JSON alone: libraries print to file descriptor 1 (DeepSpeed's op builds),
    # so fd 1 becomes stderr and the JSON goes to a duplicate of the original stdout.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    tasks = list(TASK_NAMES) if args.tasks == "all" else args.tasks.split(",")
    archs, pretrain_archs = args.archs.split(","), set(args.pretrain_archs.split(","))
    plan = [(a, p) for a in archs for p in ["pretrain"] * (a in pretrain_archs) + [f"finetune:{t}" for t in tasks]]
    init_distributed()  # before any model exists, so its gc.freeze() holds only the imports
    people = rendered_people(platform_config(args, archs[0], 1))
    runs = []
    for arch, phase in plan:
        print(f"[gpu-benchmark] {arch} {phase} ...", file=sys.stderr, flush=True)
        try:
            runs.append(benchmark(args, arch, phase, people))
            print(f"[gpu-benchmark] {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
        except Exception as err:  # one run's failure (out of memory, say) must not lose the others
            traceback.print_exc()
            runs.append({"arch": arch, "phase": phase, "error": f"{type(err).__name__}: {err}"[:500]})
        release_memory()
    print(json.dumps({
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "deepspeed": importlib.metadata.version("deepspeed"), "zero_stage": 2,
        "bf16": args.bf16, "world_size": 1, "peak_tflops": args.peak_tflops, "config_overrides": args.set,
        "flops_source": "SAPIENS2_FACTS.md GFLOPs-MAC @1024x768 (reference); see model_flops_per_image",
        "runs": runs, "ratios": ratios(runs),
    }), file=out, flush=True)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
