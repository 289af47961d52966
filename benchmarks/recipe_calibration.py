"""Calibrate a fine-tuning recipe quickly: one task, a plain PyTorch loop, scored on `val`.

Uses the platform's own pieces (the start model of `sapiens2 finetune`, its task loss with the
settings fitted to the train labels, layer-wise lr groups with the head multiplier, the lr
schedule, the evaluation's scoring with test-time flip) but no DeepSpeed, checkpoints or
tracking, so a recipe question (an lr, a head, a loss weight) costs minutes. The recipe numbers
quoted in `params.yaml` and the README's results come from this script on the demo's curated
split, one thread per run (as the demo's two training slots run). Prints one JSON object.

    python benchmarks/recipe_calibration.py --curated data/curated --task seg --steps 450 \\
        --set finetune.optim.head_lr_scale=5 --set finetune.task_settings.seg.dice_weight=2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.common.config import load_config  # noqa: E402
from pipelines.common.task_models import SCRATCH, finetune_param_groups, initial_model  # noqa: E402
from pipelines.evaluate import _dataset, _task, score  # noqa: E402
from sapiens2.data.dataset import CuratedDataset, collate  # noqa: E402
from sapiens2.tasks import TASK_NAMES  # noqa: E402
from sapiens2.train.lr_decay import apply_lr  # noqa: E402
from sapiens2.train.schedules import lr_schedule  # noqa: E402


def _config(params: Path, overrides: list[str]):
    """params.yaml with dotted `key=value` overrides (values parsed as YAML)."""
    data = yaml.safe_load(params.read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    return load_config(Path(f.name))


def calibrate(config, task_name: str, curated: Path, backbone: Path | str, steps: int, eval_every: int) -> dict:
    cfg = config.finetune
    task = config.task(task_name)
    height, width = config.image_size
    train = CuratedDataset(curated, "train", height, width, tasks=(task_name,), seed=cfg.seed,
                           person_crop_padding=task.person_crop_padding, label_fraction=cfg.label_fraction,
                           **config.dataset_keypoints())
    task = task.with_label_statistics(train[i] for i in range(len(train)))
    val, scorer = _dataset(config, curated, "val", task_name), _task(task_name, config)
    model = initial_model(config, task_name, backbone)
    task.initialise_head(model.head)
    optim = cfg.optim_for(task_name)
    groups = finetune_param_groups(model, optim, steps)
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    lrs, batch_size = lr_schedule(optim, steps), cfg.deepspeed.micro_batch_size
    generator = torch.Generator().manual_seed(cfg.seed)
    curve, losses, start = [], [], time.perf_counter()
    for step in range(steps):
        model.train()
        train.set_epoch(step)
        picks = torch.randint(len(train), (batch_size,), generator=generator)
        batch = collate([train[int(i)] for i in picks])
        loss, _ = task.loss(model(batch["image"]), batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.deepspeed.grad_clip)
        apply_lr(optimizer.param_groups, float(lrs[step]), step)
        optimizer.step()
        losses.append(float(loss.detach()))
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            curve.append([step + 1, score(model.eval(), scorer, val, config.evaluate.batch_size)[0][task.primary_metric]])
            print(f"[calibration] step {step + 1}: {task.primary_metric} {curve[-1][1]:.4f}", file=sys.stderr, flush=True)
    train_seconds = time.perf_counter() - start
    metrics, _ = score(model.eval(), scorer, val, config.evaluate.batch_size)
    curve.append([steps, metrics[task.primary_metric]])
    return {"task": task_name, "backbone": str(backbone), "steps": steps, "batch": batch_size,
            "train_seconds": round(train_seconds, 1), "seconds_per_step": round(train_seconds / steps, 4),
            "primary_metric": task.primary_metric, "value": metrics[task.primary_metric], "metrics": metrics,
            "curve": curve, "final_loss": sum(losses[-10:]) / len(losses[-10:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curated", type=Path, required=True)
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--steps", type=int, help="default: the recipe's steps for the task")
    parser.add_argument("--backbone", type=Path, help="a backbone.safetensors to start from (default: scratch)")
    parser.add_argument("--config", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted params.yaml override")
    parser.add_argument("--eval-every", type=int, default=0, help="score val every N steps too (a learning curve)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = _config(args.config, args.set)
    steps = args.steps or config.finetune.steps_for(args.task)
    result = calibrate(config, args.task, args.curated, args.backbone or SCRATCH, steps, args.eval_every)
    print(json.dumps({**result, "overrides": args.set, "threads": args.threads}, default=float))


if __name__ == "__main__":
    main()
