"""Step: self-supervised pretraining of the Sapiens2 backbone under DeepSpeed ZeRO.

On the curated train split: mixed block/patch masking, the encoder on visible tokens only, a
light MAE decoder on normalised pixels, and self-distillation from an EMA teacher on the CLS
token (sparse) and on the masked patches (dense), with Sinkhorn-Knopp targets and KoLeo
(`sapiens2.pretrain.meta_arch`, run by `sapiens2.pretrain.recipe` in the one `Trainer` loop);
collapse monitors go to MLflow every step. `sapiens2 pretrain` is the launcher
(`pipelines.common.launch`): it resolves the config, saves it in the output folder and starts
this node's ranks; each rank runs `train`. Every input of a step is a pure function of (seed,
step, rank), so a resumed run repeats the uninterrupted one. Timings go to MLflow and Dagster
only, so the folder's bytes do not depend on who ran it or how fast.

Output folder: `config.yaml` (resolved), `checkpoints/` (DeepSpeed, for resume),
`backbone.safetensors` (the backbone handed to fine-tuning: the student or the EMA teacher,
whichever the probes rate higher on the train split), `backbone.json` (summary, collapse verdict,
probes of the exported, the other and a random backbone), `history.json` (every step's losses
and collapse monitors), `loss_curves.png`, `mae_reconstruction.png` (with the MAE term on).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.common.config import PlatformConfig, load_config
from pipelines.common.launch import (
    StepLogger, add_launch_arguments, compute_tags, launch_ranks, rank_zero_pipes, resolve_config,
)
from pipelines.common.lineage import Lineage, RankZeroTracker
from pipelines.common.plots import loss_curves_png, mae_reconstruction_png
from sapiens2.data.images import load_split_images
from sapiens2.model import build_backbone, save_checkpoint
from sapiens2.pretrain.meta_arch import PretrainStudent
from sapiens2.pretrain.teacher import build_teacher
from sapiens2.pretrain.monitors import collapse_verdict
from sapiens2.pretrain.recipe import PretrainRecipe
from sapiens2.pretrain.schedules import pretrain_param_groups
from sapiens2.pretrain.selection import probe_and_choose
from sapiens2.train.checkpoint import CheckpointManager, export_full_state_dict
from sapiens2.train.engine import init_distributed, initialize
from sapiens2.train.schedules import lr_schedule
from sapiens2.train.trainer import Trainer


def build_student(config: PlatformConfig) -> PretrainStudent:
    torch.manual_seed(config.pretrain.seed)  # identical initial weights on every rank
    backbone = build_backbone(config.pretrain.arch, img_size=config.image_size)
    return PretrainStudent(backbone, config.pretrain.objective)


def train(config: PlatformConfig, curated_dir: Path, output_dir: Path, lineage: Lineage,
          restart_on_mismatch: bool = False) -> None:
    """One rank of the pretraining run (collective: every rank calls it); `restart_on_mismatch` as
    the launcher's flag."""
    rank, world_size = init_distributed()
    cfg = config.pretrain
    obj, ds = cfg.objective, cfg.deepspeed
    images, _ = load_split_images(curated_dir, "train", config.image_size)

    student = build_student(config)
    teacher = build_teacher(student)  # before ZeRO-3 partitions the student's parameters
    groups = pretrain_param_groups(student, cfg.optim, obj, cfg.steps)
    engine = initialize(student, groups, ds, cfg.optim)
    recipe = PretrainRecipe(engine, teacher, obj, images, config.image_size, ds.micro_batch_size, cfg.steps)
    full = config.to_dict()
    checkpoints = CheckpointManager.from_section(
        output_dir / "checkpoints", cfg.checkpoint,
        lineage.resume_identity({**full["pretrain"], "image_size": full["image_size"]}, world_size), restart_on_mismatch)

    with rank_zero_pipes(rank) as pipes, RankZeroTracker(rank, "pretrain", lineage, config.to_dict()) as tracker:
        trainer = Trainer(engine, recipe, lr_schedule(cfg.optim, cfg.steps), checkpoints, cfg.seed,
                          ds.grad_accum_steps)
        start = trainer.resume()
        log = StepLogger("pretrain", cfg.steps, start, pipes, enabled=rank == 0)
        compute = compute_tags()
        tracker.set_tags(compute)
        log.started(compute)
        # Collapse monitors go to MLflow every step; the console gets every log_every-th.
        trainer.hooks += [lambda step, metrics: tracker.log_metrics(metrics, step + 1),
                          log.every(cfg.log_every, ("loss", "loss_mae", "loss_cl", "loss_ibot", "loss_position",
                                                     "teacher_entropy"))]
        history = trainer.fit(cfg.steps)
        seconds = trainer.seconds
        weights = export_full_state_dict(engine)  # collective under ZeRO-3

        if rank == 0:
            trained = build_student(config)
            trained.load_state_dict(weights)
            teacher = recipe.teacher.cpu()
            output_dir.mkdir(parents=True, exist_ok=True)
            chosen, probes = probe_and_choose({"teacher": teacher.backbone, "student": trained.backbone},
                                              build_student(config).backbone, curated_dir, config.image_size)
            save_checkpoint({"teacher": teacher.backbone, "student": trained.backbone}[chosen], output_dir / "backbone.safetensors")
            final = {key: values[-1] for key, values in history.items()}
            # Without a distillation term there is no teacher to watch: the probes judge the run.
            verdict = collapse_verdict(final["teacher_entropy"], final["cls_std"], obj.dino_out_dim) \
                if obj.uses_teacher else None
            summary = {
                "arch": cfg.arch,
                "image_size": list(config.image_size),
                "steps": cfg.steps,
                "world_size": world_size,
                "zero_stage": ds.zero_stage,
                **{f"final_{key}": value for key, value in final.items()},
                "collapsed": verdict or ("no" if obj.uses_teacher else "not monitored: no distillation term"),
                "exported": chosen,
                "probes": probes,
            }
            # Timings go to MLflow and Dagster, not into the output folder: its bytes (its DVC
            # md5, the data version) must not depend on how fast or by whom it was made.
            speed = {"steps_per_second": (cfg.steps - start) / seconds if seconds > 0 else 0.0,
                     "images_per_second": (cfg.steps - start) * ds.global_batch_size / seconds if seconds > 0 else 0.0}
            if verdict:
                pipes.log.warning(f"pretraining collapsed: {verdict}")
            (output_dir / "backbone.json").write_text(json.dumps(summary, indent=2))
            (output_dir / "history.json").write_text(json.dumps(history))
            curves = loss_curves_png(history, output_dir / "loss_curves.png", title="pretraining")
            pictures, recon = [curves], output_dir / "mae_reconstruction.png"
            recon.unlink(missing_ok=True)  # an earlier run's, or an untrained decoder's, says nothing
            if obj.mae_weight > 0:
                view = recipe.reconstruction_view(6, torch.Generator().manual_seed(0))
                pictures.append(mae_reconstruction_png(trained, images[:6], view, recon, obj.mae_target))
            tracker.log_artifacts([*pictures, output_dir / "backbone.json", output_dir / "config.yaml"])
            probe_metrics = {f"probe.{name}.{key}": value for name, result in probes.items() for key, value in result.items()}
            tracker.log_metrics({**{k: v for k, v in summary.items() if isinstance(v, float)}, **probe_metrics, **speed},
                                cfg.steps)
            tracker.set_tags({"collapsed": summary["collapsed"], "exported_weights": chosen})
            pipes.report_asset_materialization(metadata={
                **{k: v for k, v in summary.items() if not isinstance(v, (list, dict))},
                **{k: round(v, 4) for k, v in probe_metrics.items()}, **speed,
                "mlflow_run_id": tracker.run_id or "",
            })
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--curated", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    if args.rank_worker:
        train(load_config(args.config), args.curated, args.output, Lineage.from_env(args.curated), args.restart_on_mismatch)
        return 0
    config = resolve_config(args)
    return launch_ranks("pipelines.pretrain", args, config, config.pretrain.deepspeed.world_size,
                        ["--curated", str(args.curated)])


if __name__ == "__main__":
    raise SystemExit(main())
