"""Does pretraining help? Pretrain once, then fine-tune every task from the pretrained backbone
and from scratch at several label fractions, with a larger budget than the demo.

Runs the platform's own steps (the `sapiens2` CLI verbs under DeepSpeed) in a work folder:
synthetic pool -> curation -> pretraining -> for each label fraction and fine-tuning seed, five
fine-tunes from the pretrained backbone and five from the random init -> evaluation against the
trivial baselines. Prints one JSON object: every metric of every model, the trivial baselines,
pretrained against scratch per task over the seeds, the probes of the pretrained and the random
backbone, the collapse verdict and the wall time of each stage; writes
`learning_curves.png` (the fine-tuning losses, pretrained vs scratch, and the pretraining curves)
into the work folder. Each task's two fine-tunings run side by side on one core each, as the
Dagster `training` pool runs them. The defaults took 41.8 and 62.5 min on 2 cores, the 10 % fraction
alone at three seeds 66.0 (README, learning benchmark). The work folder must be new or empty;
`--pretraining-from` fine-tunes on an earlier run's data and pretraining instead of making them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from pipelines.common.eval_report import improvement  # noqa: E402
from sapiens2.pretrain.config import MaeTarget  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("pose", "seg", "normal", "pointmap", "albedo")
# Masked position prediction: the objective that measured as helping at this scale
# (benchmarks/results/recipe_screens.json, position_prediction*: pose at 10 % labels 0.448 mean
# of 3 seeds after 3000 steps of 64 crops, scratch 0.432). With the other weights 0 neither the
# teacher nor the masked view runs.
POSITION_ONLY = {"position_weight": 1.0, "mae_weight": 0.0, "cl_weight": 0.0, "ibot_weight": 0.0,
                 "koleo_weight": 0.0, "n_local": 0}
# params.yaml's objective overrides per --objective, and the steps each gets by default.
OBJECTIVES = {
    "position": (POSITION_ONLY, 2800),
    # The MAE decoder reads the position branch's pass: one encoder pass for both terms, 3.7 steps/s
    # against 5.2 for position alone and 2.7 for MAE on its own masked view. Screened at 10 % labels
    # (3 seeds, transfer_screens.json): the only backbone whose mean beats scratch on normal, albedo,
    # pose and seg together.
    "position-mae": ({**POSITION_ONLY, "mae_weight": 1.0, "mae_view": "position"}, 2800),
    "paper": ({}, 1200),
}


def _run(args: list[str], env: dict, log: Path) -> float:
    """Run one CLI verb, its output into `log`; returns the seconds it took."""
    return _run_together([(args, log)], env)[0]


def _run_together(runs: list[tuple[list[str], Path]], env: dict) -> list[float]:
    """Run CLI verbs at once (each output into its log), as the Dagster `training` pool runs two
    fine-tunings at a time on half the cores each; returns each one's seconds."""
    start = time.perf_counter()
    procs = []
    for args, log in runs:
        out = log.open("w")
        procs.append((subprocess.Popen([sys.executable, "-m", "pipelines.cli", *args], env=env, cwd=ROOT,
                                       stdout=out, stderr=subprocess.STDOUT), out, args, log))
    seconds = []
    for proc, out, args, log in procs:
        code = proc.wait()
        out.close()
        seconds.append(time.perf_counter() - start)
        if code != 0:
            raise SystemExit(f"{' '.join(args[:2])} failed; see {log}")
    return seconds


def _params(work: Path, args: argparse.Namespace) -> Path:
    """params.yaml of this benchmark: the demo recipe with the larger pool and budget."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["synth"]["n_people"] = args.people
    params["pretrain"]["steps"] = args.pretrain_steps
    params["pretrain"]["objective"].update(OBJECTIVES[args.objective][0], mae_target=args.mae_target)
    if args.objective != "paper":
        params["pretrain"]["deepspeed"]["micro_batch_size"] = 16  # 32 images, 64 global crops a step
    params["finetune"]["steps"] = args.finetune_steps
    task_steps = {"pose": args.pose_steps, "seg": min(args.seg_steps), "normal": args.normal_steps,
                  "albedo": args.albedo_steps}
    params["finetune"]["task_steps"] = task_steps
    task_optim = params["finetune"].setdefault("task_optim", {})
    task_optim["normal"] = {"backbone_frozen_fraction": args.normal_frozen_fraction}
    # One checkpoint at the end of the longest run (a fraction's seg steps may exceed task_steps').
    longest = max(*task_steps.values(), *args.seg_steps, args.finetune_steps)
    params["finetune"]["checkpoint"]["every_n_steps"] = longest
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


# The params.yaml sections that make the data and the pretraining; fine-tuning reads the rest.
UPSTREAM = ("image_size", "raw_source", "synth", "curation", "pretrain")


def _reuse_pretraining(source: Path, work: Path, params: Path) -> None:
    """Link `source`'s data and pretraining into `work` (an earlier run of this benchmark with the
    same upstream settings), so a fine-tuning question costs no new 17-minute pretraining."""
    theirs_path = source / "params.yaml"
    if not (source / "models" / "pretrain" / "backbone.safetensors").is_file() or not theirs_path.is_file():
        raise SystemExit(f"--pretraining-from {source}: no finished pretraining there "
                         "(params.yaml and models/pretrain/backbone.safetensors)")
    mine, theirs = yaml.safe_load(params.read_text()), yaml.safe_load(theirs_path.read_text())
    differ = [key for key in UPSTREAM if mine.get(key) != theirs.get(key)]
    if differ:
        raise SystemExit(f"--pretraining-from {source}: {theirs_path} differs from this run's settings in "
                         f"{', '.join(differ)}; its data and pretraining are not this run's")
    (work / "models").mkdir()
    (work / "data").symlink_to(source / "data", target_is_directory=True)
    (work / "models" / "pretrain").symlink_to(source / "models" / "pretrain", target_is_directory=True)


def _tag(fraction: float, seed: int) -> str:
    """One fine-tuning draw's folder `labels_<tag>`, results key and timing prefix; seed 0 has no
    suffix, so a one-seed run keeps the earlier runs' layout."""
    return f"{fraction:g}" + (f"_seed{seed}" if seed else "")


def _pretrained_vs_scratch(results: dict, fractions: list[float], seeds: list[int]) -> dict:
    """Per label fraction and task, the primary metric of both starts at every seed, their means and
    how many seeds the pretrained start wins: one draw's margin can be noise (README)."""
    summary = {}
    for fraction in fractions:
        draws = [{r["task"]: r for r in results[f"labels_{_tag(fraction, seed)}"]} for seed in seeds]
        tasks = {}
        for task in TASKS:
            first = draws[0][task]
            metric, higher = first["primary_metric"], first["higher_is_better"]
            pretrained = [d[task]["metrics"][metric] for d in draws]
            scratch = [d[task]["scratch"][metric] for d in draws]
            pretrained_mean, scratch_mean = sum(pretrained) / len(seeds), sum(scratch) / len(seeds)
            tasks[task] = {
                "metric": metric, "higher_is_better": higher, "seeds": seeds,
                "pretrained": pretrained, "scratch": scratch,
                "pretrained_mean": pretrained_mean, "scratch_mean": scratch_mean,
                "seeds_pretrained_better": sum(improvement(p, s, higher) > 0 for p, s in zip(pretrained, scratch)),
                "pretrained_better_by_mean": improvement(pretrained_mean, scratch_mean, higher) > 0,
            }
        wins = sum(t["pretrained_better_by_mean"] for t in tasks.values())
        summary[f"{fraction:g}"] = {"tasks": tasks, "tasks_pretrained_better_by_mean": wins}
    return summary


def _curves_png(work: Path, fractions: list[float], seed: int, path: Path) -> Path:
    """The pretraining curves, then each fraction's fine-tuning losses of one seed, both starts."""
    fig, axes = plt.subplots(len(fractions) + 1, len(TASKS), figsize=(4 * len(TASKS), 3 * (len(fractions) + 1)),
                             squeeze=False)
    pretrain = json.loads((work / "models" / "pretrain" / "history.json").read_text())
    # The pretraining terms that were on (a term with weight 0 logs 0), then the collapse monitors.
    shown = [key for key in ("loss_mae", "loss_cl", "loss_ibot", "loss_position", "teacher_entropy", "cls_std")
             if any(pretrain.get(key, []))][: len(TASKS)]
    for ax, key in zip(axes[0], shown):
        ax.plot(pretrain[key], lw=1)
        ax.set_title(f"pretraining: {key}")
    for ax in axes[0][len(shown):]:
        ax.set_visible(False)
    for row, fraction in enumerate(fractions, start=1):
        for ax, task in zip(axes[row], TASKS):
            for init, style in (("pretrained", "-"), ("scratch", "--")):
                run = work / f"labels_{_tag(fraction, seed)}"
                history = json.loads((run / init / task / "history.json").read_text())
                ax.plot(history["loss"], style, lw=1, label=init)
            ax.set_title(f"{task}, {fraction:.0%} labels, seed {seed}")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "learning")
    parser.add_argument("--people", type=int, default=1600, help="person renders in the pretraining pool")
    parser.add_argument("--objective", choices=tuple(OBJECTIVES), default="position-mae",
                        help="pretraining objective: position prediction alone (POSITION_ONLY), with MAE reading "
                             "its pass, or params.yaml's MAE + self-distillation")
    parser.add_argument("--mae-target", choices=get_args(MaeTarget), default="normalized",
                        help="pretrain.objective.mae_target: per-patch normalised pixels or the pixels as they are")
    # Position prediction's transfer grows with steps (screen, pose at 10 % labels, 3 seeds: below
    # scratch after 1000, +0.016 after 3000, +0.054 after 6000); 2800 steps (13 min with MAE on its
    # pass, 9 alone) is what the 45 minutes leave. The paper objective ran 1200 steps of 16 images
    # (5.8 min; more of it cost pose, README).
    parser.add_argument("--pretrain-steps", type=int, help="default: 2800 (position, position-mae), 1200 (paper)")
    parser.add_argument("--finetune-steps", type=int, default=200, help="pointmap")
    # Above the demo's seg 600 / pose 450 / dense 70 and pretraining 150 steps on half the images.
    # Plain loop, scratch, this benchmark's split: normal 23.6 deg at step 200 of 400 and 21.3 at
    # 400; albedo 17.81 dB at 400; seg 0.218 at 700 of 1400 and 0.272 at 1400; pose 0.466 at 700.
    # Seg steps per label fraction (one value: all fractions). At 100 % labels the bar is mIoU >= 0.30:
    # plain loop, scratch, seed 0, this split: 0.293 at the end of a 2100-step run, 0.301 of 2800.
    # 2800 at 100 %, not 3000, to pay for the pretraining (3000: 0.324 pretrained, 0.317 scratch).
    parser.add_argument("--seg-steps", type=int, nargs="+", default=[700, 2800],
                        help="one per --label-fractions, or one for all")
    parser.add_argument("--pose-steps", type=int, default=500)
    parser.add_argument("--normal-steps", type=int, default=400)
    # Normal's fine-tuning washes out a pretrained start and its image-pyramid head carries most of
    # the task; holding the backbone for the first half keeps what the pretrained one has and leaves
    # scratch as it was on average (plain loop, 10 % labels, seeds 0-4: pretrained 20.88 vs scratch
    # 21.16 deg, fully fine-tuned 21.05 vs 21.13; transfer_screens.json, normal_backbone_freeze).
    parser.add_argument("--normal-frozen-fraction", type=float, default=0.5,
                        help="normal's finetune.optim.backbone_frozen_fraction (both starts)")
    parser.add_argument("--albedo-steps", type=int, default=400)
    parser.add_argument("--label-fractions", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--pretraining-from", type=Path, metavar="WORK",
                        help="an earlier run's work folder whose data and pretraining to reuse (same synth, "
                             "curation and pretraining settings, checked); total_seconds leaves them out")
    # One draw is one sample of a chaotic run: the kernel set alone moved scratch pose at 10 % labels
    # from 0.402 (AVX-512) to 0.419-0.423 AP (AVX2), and seed 1 gave 0.387 (README, learning benchmark).
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="fine-tuning seeds (finetune.seed: the labelled subset, the head's init, the batch "
                             "order); every fraction runs every task from both starts at each")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    args.pretrain_steps = args.pretrain_steps or OBJECTIVES[args.objective][1]
    if len(args.seg_steps) not in (1, len(args.label_fractions)):
        parser.error(f"--seg-steps takes one value or one per label fraction ({len(args.label_fractions)}), "
                     f"got {len(args.seg_steps)}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    per_fraction = args.seg_steps * len(args.label_fractions) if len(args.seg_steps) == 1 else args.seg_steps
    seg_steps = dict(zip(args.label_fractions, per_fraction))
    work = args.work.resolve()
    if work.exists() and any(work.iterdir()):
        # Its steps would resume from the old checkpoints: a stale, faster and mixed measurement.
        raise SystemExit(f"{work} is not empty; delete it or pass another --work")
    work.mkdir(parents=True, exist_ok=True)
    params = _params(work, args)
    env = {**os.environ, "SAPIENS2_WORKSPACE": str(work), "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    curated, pretrained = work / "data" / "curated", work / "models" / "pretrain"
    config = ["--config", str(params)]
    started = time.perf_counter()
    reused = args.pretraining_from.resolve() if args.pretraining_from else None
    if reused:
        _reuse_pretraining(reused, work, params)
        seconds = {}
    else:
        seconds = {
            "synth": _run(["synth", "--output", str(work / "data" / "raw"), *config], env, work / "synth.log"),
            "curate": _run(["curate", "--input", str(work / "data" / "raw"), "--output", str(curated), *config],
                           env, work / "curate.log"),
            "pretrain": _run(["pretrain", "--curated", str(curated), "--output", str(pretrained), *config], env,
                             work / "pretrain.log"),
        }
    settings = vars(args) | {"work": str(work), "pretraining_from": reused and str(reused)}
    results: dict = {"settings": settings, "seconds": seconds}
    for fraction in args.label_fractions:
        for seed in args.seeds:
            tag = _tag(fraction, seed)
            run = work / f"labels_{tag}"
            run.mkdir(exist_ok=True)
            label = ["--set", f"finetune.label_fraction={fraction}", "--set", f"finetune.seed={seed}",
                     "--set", f"finetune.task_steps.seg={seg_steps[fraction]}"]
            for task in TASKS:  # the model and its control side by side, one core each
                inits = (("pretrained", ["--backbone", str(pretrained)]), ("scratch", ["--from-scratch"]))
                took = _run_together([(["finetune", "--task", task, "--curated", str(curated), *start, "--output",
                                        str(run / init / task), *config, *label], run / f"{init}_{task}.log")
                                      for init, start in inits], env)
                seconds.update({f"{tag}/{init}/{task}": t for (init, _), t in zip(inits, took)})
            seconds[f"{tag}/evaluate"] = _run(
                ["evaluate", "--curated", str(curated), "--models", str(run / "pretrained"), "--scratch-models",
                 str(run / "scratch"), "--output", str(run / "eval"), *config], env, run / "evaluate.log")
            results[f"labels_{tag}"] = json.loads((run / "eval" / "metrics.json").read_text())["tasks"]
    results["pretrained_vs_scratch"] = _pretrained_vs_scratch(results, args.label_fractions, args.seeds)
    pretrain_summary = json.loads((pretrained / "backbone.json").read_text())
    results["pretraining"] = {k: v for k, v in pretrain_summary.items() if k != "image_size"}
    results["learning_curves"] = str(_curves_png(work, args.label_fractions, args.seeds[0],
                                                 work / "learning_curves.png"))
    results["total_seconds"] = time.perf_counter() - started  # wall time: the fine-tunings overlap
    print(json.dumps(results, default=float))


if __name__ == "__main__":
    main()
