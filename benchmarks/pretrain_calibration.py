"""Calibrate the pretraining recipe quickly: a plain PyTorch loop, probes on `val` along the way.

The pretraining counterpart of `recipe_calibration.py`: the platform's own student, EMA teacher,
multi-crop, masking, objective schedules, layer-wise groups (prototype layers frozen first) and lr
schedule, one process, no DeepSpeed, checkpoints or tracking. Every `--probe-every` steps it runs
the pretraining probes (viewpoint k-NN, part correspondence) on the student and the teacher, and
once on the random backbone, so a recipe question (a crop scale, a loss weight, more steps) shows
its learning curve in minutes. `--export` writes the final student and teacher backbones, which
`recipe_calibration.py --backbone` fine-tunes. Prints one JSON object.

    python benchmarks/pretrain_calibration.py --curated data/curated --steps 600 --probe-every 150 \\
        --set pretrain.objective.ibot_weight=2 --export /tmp/pt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.recipe_calibration import _config  # noqa: E402
from pipelines.pretrain import build_student  # noqa: E402
from sapiens2.data.images import load_split_images  # noqa: E402
from sapiens2.model import save_checkpoint  # noqa: E402
from sapiens2.pretrain.meta_arch import LOSS_KEYS, MONITOR_KEYS  # noqa: E402
from sapiens2.pretrain.teacher import build_teacher  # noqa: E402
from sapiens2.pretrain.probes import run_probes  # noqa: E402
from sapiens2.pretrain.recipe import PretrainRecipe  # noqa: E402
from sapiens2.pretrain.schedules import pretrain_param_groups  # noqa: E402
from sapiens2.pretrain.selection import probe_batches  # noqa: E402
from sapiens2.train.engine import set_lr  # noqa: E402
from sapiens2.train.schedules import lr_schedule  # noqa: E402

PROBE_KEYS = ("knn_viewpoint_acc", "part_correspondence_acc", "patch_image_identity")


class PlainEngine:
    """What `PretrainRecipe` and `set_lr` read of a DeepSpeed engine, for a module trained in fp32
    on CPU by a plain optimizer."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer, self.device = module, optimizer, torch.device("cpu")

    def __call__(self, *args):
        return self.module(*args)

    def bfloat16_enabled(self) -> bool:
        return False


def calibrate(config, curated: Path, steps: int, batch_size: int, probe_every: int, export: Path | None) -> dict:
    cfg, obj = config.pretrain, config.pretrain.objective
    images, _ = load_split_images(curated, "train", config.image_size)
    student = build_student(config)
    random_backbone = build_student(config).backbone
    teacher = build_teacher(student)
    groups = pretrain_param_groups(student, cfg.optim, obj, steps)
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps)
    engine = PlainEngine(student, optimizer)
    recipe = PretrainRecipe(engine, teacher, obj, images, config.image_size, batch_size, steps)
    lrs, generator = lr_schedule(cfg.optim, steps), torch.Generator().manual_seed(cfg.seed)
    train, val = (probe_batches(curated, split, config.image_size) for split in ("train", "val"))

    def probe(backbone: torch.nn.Module) -> dict[str, float]:
        return {key: round(value, 4) for key, value in run_probes(backbone, train, val).items()}

    floors = probe(random_backbone)
    curve, history, start = [], {}, time.perf_counter()
    for step in range(steps):
        student.train()
        out = recipe.loss(step, generator)
        optimizer.zero_grad()
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.deepspeed.grad_clip)
        set_lr(engine, float(lrs[step]), step)  # the Trainer's rule: prototypes frozen at first
        optimizer.step()
        recipe.after_step(step)
        for key in (k for k in LOSS_KEYS + MONITOR_KEYS if k in out):  # no teacher monitors without a teacher
            history.setdefault(key, []).append(float(out[key].detach()))
        if (probe_every and (step + 1) % probe_every == 0) or step + 1 == steps:
            point = {"step": step + 1, "seconds": round(time.perf_counter() - start, 1)}
            for name, backbone in (("student", student.backbone), ("teacher", recipe.teacher.backbone)):
                probes = probe(backbone)
                point[name] = {key: probes[key] for key in PROBE_KEYS}
            curve.append(point)
            print(f"[pretrain calibration] {json.dumps(point)}", file=sys.stderr, flush=True)
    if export:
        save_checkpoint(student.backbone, export / "student.safetensors")
        save_checkpoint(recipe.teacher.backbone, export / "teacher.safetensors")
    final = {key: round(sum(values[-10:]) / len(values[-10:]), 4) for key, values in history.items()}
    return {"steps": steps, "batch": batch_size, "seconds": round(time.perf_counter() - start, 1),  # probes included
            "random": floors, "curve": curve, "final": final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curated", type=Path, required=True)
    parser.add_argument("--steps", type=int, help="default: the recipe's pretrain.steps")
    parser.add_argument("--batch", type=int, help="default: the recipe's global batch (micro batch x ranks)")
    parser.add_argument("--probe-every", type=int, default=0)
    parser.add_argument("--export", type=Path, help="folder for student.safetensors and teacher.safetensors")
    parser.add_argument("--config", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted params.yaml override")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = _config(args.config, args.set)
    ds = config.pretrain.deepspeed
    batch = args.batch or ds.micro_batch_size * ds.world_size * ds.grad_accum_steps
    result = calibrate(config, args.curated, args.steps or config.pretrain.steps, batch, args.probe_every, args.export)
    print(json.dumps({**result, "overrides": args.set, "threads": args.threads}))


if __name__ == "__main__":
    main()
