"""Step: fine-tune one task (pose, seg, normal, pointmap, albedo) on the pretrained backbone.

A light head on the backbone feature map, trained under DeepSpeed with layer-wise lr decay
(embeddings rate^(L+1), block i rate^(L-i), head 1) and no weight decay on 1-D params and biases.
The backbone starts from our pretraining output or, when `finetune.init_checkpoint` is set, from a
published Sapiens2 checkpoint. The loop is the one `Trainer` (`sapiens2.tasks.recipe` says what
a batch and its loss are); batches are a pure function of (seed, step, rank).

Output folder: `config.yaml`, `checkpoints/` (DeepSpeed, for resume), `model.safetensors` (backbone
+ head), `model.json` (what to rebuild it with; the backbone path relative to the folder),
`history.json` (every step's loss terms), `loss_curves.png`. No timings and no absolute paths, so
the same inputs give the same bytes under the CLI, DVC and Dagster (tested).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipelines.common.config import PlatformConfig, load_config
from pipelines.common.launch import (
    StepLogger, add_launch_arguments, compute_tags, launch_ranks, rank_zero_pipes, resolve_config,
)
from pipelines.common.lineage import Lineage, RankZeroTracker
from pipelines.common.plots import loss_curves_png
from pipelines.common.task_models import (
    SCRATCH, backbone_weights, finetune_param_groups, initial_model, record_backbone,
)
from sapiens2.data.dataset import CuratedDataset
from sapiens2.model import save_checkpoint
from sapiens2.tasks import TASK_NAMES
from sapiens2.tasks.recipe import FinetuneRecipe
from sapiens2.train.checkpoint import CheckpointManager, export_full_state_dict
from sapiens2.train.engine import init_distributed, initialize
from sapiens2.train.schedules import lr_schedule
from sapiens2.train.trainer import Trainer


def train(config: PlatformConfig, task_name: str, curated_dir: Path, backbone_path: Path | str, output_dir: Path,
          lineage: Lineage, restart_on_mismatch: bool = False) -> None:
    """One rank of a fine-tuning run (collective); `restart_on_mismatch` as the launcher's flag."""
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
    # Settings fitted to the training labels (seg class weights) come from the same images the
    # run trains on, so a label fraction or another dataset gets its own.
    task = task.with_label_statistics(data[i] for i in range(len(data)))
    model = initial_model(config, task_name, backbone_path)
    task.initialise_head(model.head)
    optim = cfg.optim_for(task_name)
    groups = finetune_param_groups(model, optim, steps)
    engine = initialize(model, groups, ds, optim)
    full = config.to_dict()
    settings = {**full["finetune"], "task": task_name, "image_size": full["image_size"], "arch": full["pretrain"]["arch"],
              "init": "scratch" if str(backbone_path) == SCRATCH else "pretrained"}
    checkpoints = CheckpointManager.from_section(output_dir / "checkpoints", cfg.checkpoint,
                                                 lineage.resume_identity(settings, world_size), restart_on_mismatch)
    run_name = f"{task_name}-scratch" if str(backbone_path) == SCRATCH else task_name

    with rank_zero_pipes(rank) as pipes, RankZeroTracker(rank, "finetune", lineage, config.to_dict(), run_name=run_name) as tracker:
        trainer = Trainer(engine, FinetuneRecipe(engine, task, data, ds.micro_batch_size), lr_schedule(optim, steps),
                          checkpoints, cfg.seed, ds.grad_accum_steps)
        start = trainer.resume()
        log = StepLogger(f"finetune {task_name}", steps, start, pipes, enabled=rank == 0)
        compute = compute_tags()
        tracker.set_tags(compute)
        log.started(compute)

        def track(step: int, metrics: dict[str, float]) -> None:
            if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
                tracker.log_metrics(metrics, step + 1)

        trainer.hooks += [log.every(cfg.log_every), track]
        history = trainer.fit(steps)
        seconds = trainer.seconds
        weights = export_full_state_dict(engine)

        if rank == 0:
            output_dir.mkdir(parents=True, exist_ok=True)
            final = initial_model(config, task_name, backbone_path)
            final.load_state_dict(weights)
            save_checkpoint(final, output_dir / "model.safetensors")
            spec = {
                "task": task_name, "arch": config.pretrain.arch, "image_size": list(config.image_size),
                "backbone_init": record_backbone(backbone_path, output_dir), "steps": steps, "seed": cfg.seed,
                "label_fraction": cfg.label_fraction, "train_images": len(data),
                "task_settings": config.task_settings(task_name),
                "final_loss": history["loss"][-1],
            }
            # Speed goes to MLflow and Dagster only: the folder's bytes must not depend on it.
            steps_per_second = (steps - start) / seconds if seconds > 0 else 0.0
            tracker.log_metrics({"steps_per_second": steps_per_second}, steps)
            (output_dir / "model.json").write_text(json.dumps(spec, indent=2))
            (output_dir / "history.json").write_text(json.dumps(history))
            curves = loss_curves_png(history, output_dir / "loss_curves.png", title=f"fine-tuning {task_name}")
            tracker.log_artifacts([curves, output_dir / "model.json", output_dir / "config.yaml"])
            pipes.report_asset_materialization(metadata={
                "final_loss": spec["final_loss"], "steps": steps, "steps_per_second": steps_per_second,
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
    add_launch_arguments(parser)
    args = parser.parse_args(argv)

    def backbone_path(config: PlatformConfig) -> Path | str:
        return SCRATCH if args.from_scratch else backbone_weights(config, args.backbone)

    if args.rank_worker:
        config = load_config(args.config)
        published = config.finetune.init_checkpoint and not args.from_scratch
        lineage = Lineage.from_env(args.curated, None if args.from_scratch or published else args.backbone)
        if published:  # not a DVC output: recorded (and checked on resume) by its bytes
            lineage = lineage.with_backbone_file(backbone_path(config))
        train(config, args.task, args.curated, backbone_path(config), args.output, lineage, args.restart_on_mismatch)
        return 0
    config = resolve_config(args)
    path = backbone_path(config)
    if path != SCRATCH and not Path(path).is_file():
        raise SystemExit(f"sapiens2 finetune: backbone checkpoint {path} does not exist")
    start_args = ["--from-scratch"] if args.from_scratch else ["--backbone", str(args.backbone)]
    return launch_ranks("pipelines.finetune", args, config, config.finetune.deepspeed.world_size,
                        ["--task", args.task, "--curated", str(args.curated), *start_args])


if __name__ == "__main__":
    raise SystemExit(main())
