"""Step: fine-tune one task (pose, seg, normal, pointmap, albedo) on the pretrained backbone.

A light head on the backbone feature map, trained under DeepSpeed with layer-wise lr decay
(embeddings rate^(L+1), block i rate^(L-i), head 1) and no weight decay on 1-D params and biases.
The backbone starts from our pretraining output or, when `finetune.init_checkpoint` is set, from a
published Sapiens2 checkpoint. Batches are a pure function of (seed, step, rank).

Output folder: `config.yaml`, `checkpoints/` (DeepSpeed, for resume), `model.safetensors` (backbone
+ head), `model.json` (what to rebuild it with), `history.json` (every step's loss),
`loss_curves.png`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipelines.config import PlatformConfig, load_config
from pipelines.launch import StepLogger, parse_overrides, rank_zero_pipes, run_ranks, save_resolved
from pipelines.lineage import Lineage, RankZeroTracker
from pipelines.plots import loss_curves_png
from pipelines.pretrain import step_generator
from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.model import build_backbone, load_checkpoint, save_checkpoint
from sapiens2.tasks import TASK_NAMES, TaskModel, build_task_model
from sapiens2.train.checkpoint import CheckpointManager, export_full_state_dict
from sapiens2.train.engine import autocast_inputs, init_distributed, initialize, set_lr
from sapiens2.train.lr_decay import layerwise_param_groups
from sapiens2.train.schedules import lr_schedule


# `backbone_init` of a from-scratch control: the backbone starts from its seeded random init.
SCRATCH = "scratch"


def backbone_weights(config: PlatformConfig, backbone_dir: Path) -> Path:
    """The backbone fine-tuning starts from: a published checkpoint if configured, else ours."""
    if config.finetune.init_checkpoint:
        return Path(config.finetune.init_checkpoint)
    return backbone_dir / "backbone.safetensors"


def initial_model(config: PlatformConfig, task: str, backbone_path: Path | str) -> TaskModel:
    """Backbone weights from `backbone_path` (or, for `SCRATCH`, the seeded random init the
    pretraining run started from) plus a freshly initialised head (seeded): the model fine-tuning
    starts from, and the untrained-head baseline evaluation compares against."""
    torch.manual_seed(config.pretrain.seed)
    backbone = build_backbone(config.pretrain.arch, img_size=config.image_size)
    if str(backbone_path) != SCRATCH:
        load_checkpoint(backbone, Path(backbone_path))
    torch.manual_seed(config.finetune.seed)
    return build_task_model(task, backbone, **config.task_settings(task))


def _to_float(pred):
    if isinstance(pred, dict):
        return {k: v.float() for k, v in pred.items()}
    return pred.float()


def train(config: PlatformConfig, task_name: str, curated_dir: Path, backbone_path: Path | str, output_dir: Path,
          lineage: Lineage) -> None:
    """One rank of a fine-tuning run (collective)."""
    rank, world_size = init_distributed()
    cfg, ds = config.finetune, config.finetune.deepspeed
    steps = cfg.steps_for(task_name)
    task = config.task(task_name)
    height, width = config.image_size
    keypoints = config.dataset_keypoints()
    augment = cfg.augmentation(keypoints["flip_pairs"])
    data = CuratedDataset(curated_dir, "train", height, width, tasks=(task_name,), seed=cfg.seed, augment=augment,
                          person_crop_padding=task.person_crop_padding, label_fraction=cfg.label_fraction,
                          **(keypoints if augment is None else {"num_keypoints": keypoints["num_keypoints"]}))
    model = initial_model(config, task_name, backbone_path)
    groups = layerwise_param_groups(
        model, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.layer_decay, model.backbone.depth, model.backbone.layer_id
    )
    engine = initialize(model, groups, ds, cfg.optim)
    full = config.to_dict()
    recipe = {**full["finetune"], "task": task_name, "image_size": full["image_size"], "arch": full["pretrain"]["arch"],
              "init": "scratch" if str(backbone_path) == SCRATCH else "pretrained"}
    checkpoints = CheckpointManager.from_section(output_dir / "checkpoints", cfg.checkpoint,
                                                 lineage.resume_identity(recipe, world_size))
    start, history = 0, {"loss": []}
    resumed = checkpoints.resume(engine)
    if resumed is not None:
        start, state = resumed
        history = state["history"]
    lrs = lr_schedule(cfg.optim, steps)
    run_name = f"{task_name}-scratch" if str(backbone_path) == SCRATCH else task_name

    with rank_zero_pipes(rank) as pipes, RankZeroTracker(rank, "finetune", lineage, config.to_dict(), run_name=run_name) as tracker:
        log = StepLogger(f"finetune {task_name}", steps, start, pipes, enabled=rank == 0)
        log.resumed()
        started = time.perf_counter()
        for step in range(start, steps):
            set_lr(engine, float(lrs[step]))
            data.set_epoch(step)
            terms: dict[str, float] = {}
            for micro in range(ds.grad_accum_steps):
                g = step_generator(cfg.seed, step, rank, micro)
                batch = collate([data[int(i)] for i in torch.randint(len(data), (ds.micro_batch_size,), generator=g)])
                pred = _to_float(engine(autocast_inputs(engine, batch["image"])))
                loss, parts = task.loss(pred, batch)
                engine.backward(loss)
                engine.step()
                for key, value in parts.items():
                    terms[key] = terms.get(key, 0.0) + value / ds.grad_accum_steps
            history["loss"].append(terms["loss"])
            if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
                log(step, {**terms, "lr": float(lrs[step])})
                tracker.log_metrics({**terms, "lr": float(lrs[step])}, step + 1)
            if checkpoints.should_save(step + 1):
                checkpoints.save(engine, step + 1, {"history": history})
        seconds = time.perf_counter() - started
        weights = export_full_state_dict(engine)

        if rank == 0:
            output_dir.mkdir(parents=True, exist_ok=True)
            final = initial_model(config, task_name, backbone_path)
            final.load_state_dict(weights)
            save_checkpoint(final, output_dir / "model.safetensors")
            spec = {
                "task": task_name, "arch": config.pretrain.arch, "image_size": list(config.image_size),
                "backbone_init": str(backbone_path), "steps": steps, "seed": cfg.seed,
                "label_fraction": cfg.label_fraction, "train_images": len(data),
                "task_settings": config.task_settings(task_name),
                "final_loss": history["loss"][-1],
                "steps_per_second": (steps - start) / seconds if seconds > 0 else 0.0,
            }
            (output_dir / "model.json").write_text(json.dumps(spec, indent=2))
            (output_dir / "history.json").write_text(json.dumps(history))
            curves = loss_curves_png(history, output_dir / "loss_curves.png", title=f"fine-tuning {task_name}")
            tracker.log_artifacts([curves, output_dir / "model.json", output_dir / "config.yaml"])
            pipes.report_asset_materialization(metadata={
                "final_loss": spec["final_loss"], "steps": steps, "steps_per_second": spec["steps_per_second"],
                "backbone_init": spec["backbone_init"], "mlflow_run_id": tracker.run_id or "",
            })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--curated", type=Path, required=True)
    start = parser.add_mutually_exclusive_group(required=True)
    start.add_argument("--backbone", type=Path, help="pretraining output folder")
    start.add_argument("--from-scratch", action="store_true",
                       help="the control: the same recipe from the randomly initialised backbone")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def backbone_path(config: PlatformConfig) -> Path | str:
        return SCRATCH if args.from_scratch else backbone_weights(config, args.backbone)

    if args.rank_worker:
        config = load_config(args.config)
        pretrained = None if args.from_scratch or config.finetune.init_checkpoint else args.backbone
        train(config, args.task, args.curated, backbone_path(config), args.output, Lineage.from_env(args.curated, pretrained))
        return 0
    config = load_config(args.config, parse_overrides(args.set))
    path = backbone_path(config)
    if path != SCRATCH and not Path(path).is_file():
        raise SystemExit(f"sapiens2 finetune: backbone checkpoint {path} does not exist")
    resolved = save_resolved(config.to_dict(), args.output / "config.yaml")
    start_args = ["--from-scratch"] if args.from_scratch else ["--backbone", str(args.backbone)]
    worker = ["--task", args.task, "--curated", str(args.curated), *start_args,
              "--output", str(args.output), "--config", str(resolved), "--rank-worker"]
    return run_ranks("pipelines.finetune", config.finetune.deepspeed.world_size, worker)


if __name__ == "__main__":
    raise SystemExit(main())
