"""One fine-tuning step (forward and backward, one thread) with the platform's dense-loss kernels
against the torch formulations they replaced, interleaved in one process.

The reference arm swaps back `F.cosine_similarity`, `F.normalize` and `torch.linalg.cross` over
the channel axis (`sapiens2/tasks/channels.py` says why they were slow) and the one-hot softmax
Dice; everything else (model, batch, task settings fitted to the train labels) is shared, and the
two arms alternate step by step so that a noisy machine slows both alike. Prints one JSON object:
per task the median step of each arm, their ratio and both losses (equal up to float rounding).

    python benchmarks/dense_kernels.py --curated data/curated
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sapiens2.tasks.losses as losses  # noqa: E402
import sapiens2.tasks.normal as normal  # noqa: E402
import sapiens2.tasks.pointmap as pointmap  # noqa: E402
import sapiens2.tasks.seg as seg  # noqa: E402
from pipelines.common.config import load_config  # noqa: E402
from pipelines.common.task_models import SCRATCH, initial_model  # noqa: E402
from sapiens2.data.dataset import CuratedDataset, collate  # noqa: E402

# (module, attribute) -> the torch formulation it replaced.
SITES = {
    (losses, "channel_cosine"): lambda a, b, eps=1e-8: F.cosine_similarity(a, b, dim=1, eps=eps),
    (normal, "unit_channels"): lambda x, eps=1e-12: F.normalize(x, dim=1, eps=eps),
    (pointmap, "channel_cross"): lambda a, b: torch.linalg.cross(a, b, dim=1),
}


def one_hot_dice(logits, target, ignore_index, exclude=(0,), smooth=1.0):
    """The softmax Dice as first written: probabilities times a one-hot (B, C, H, W) mask."""
    num_classes = logits.shape[1]
    valid = (target != ignore_index)[:, None]
    probs = logits.softmax(dim=1) * valid
    one_hot = F.one_hot(torch.where(valid[:, 0], target, 0), num_classes).permute(0, 3, 1, 2) * valid
    inter = (probs * one_hot).sum(dim=(0, 2, 3))
    dice = (2 * inter + smooth) / (probs.sum(dim=(0, 2, 3)) + one_hot.sum(dim=(0, 2, 3)) + smooth)
    keep = torch.ones(num_classes, dtype=torch.bool)
    keep[list(exclude)] = False
    return (1.0 - dice[keep]).mean()


SITES[(seg, "softmax_dice_loss")] = one_hot_dice
PLATFORM = {site: getattr(*site) for site in SITES}


def use(kernels: dict) -> None:
    for (module, name), fn in kernels.items():
        setattr(module, name, fn)


def measure(config, curated: Path, task_name: str, repeats: int, batch_size: int) -> dict:
    task = config.task(task_name)
    height, width = config.image_size
    train = CuratedDataset(curated, "train", height, width, tasks=(task_name,), seed=0,
                           person_crop_padding=task.person_crop_padding, **config.dataset_keypoints())
    task = task.with_label_statistics(train[i] for i in range(len(train)))
    model = initial_model(config, task_name, SCRATCH)
    task.initialise_head(model.head)
    batch = collate([train[i] for i in range(batch_size)])

    def step(kernels: dict) -> tuple[float, float]:
        use(kernels)
        model.zero_grad()
        start = time.perf_counter()
        loss, _ = task.loss(model(batch["image"]), batch)
        loss.backward()
        return time.perf_counter() - start, float(loss.detach())

    arms = {"reference": SITES, "platform": PLATFORM}
    for _ in range(3):  # warm-up: allocator, oneDNN primitives
        for kernels in arms.values():
            step(kernels)
    seconds = {name: [] for name in arms}
    for i in range(repeats):
        for name in (arms if i % 2 else reversed(list(arms))):
            seconds[name].append(step(arms[name])[0])
    median = {name: sorted(values)[len(values) // 2] * 1000 for name, values in seconds.items()}
    result = {f"{name}_ms": round(ms, 1) for name, ms in median.items()}
    result["ratio"] = round(median["platform"] / median["reference"], 3)
    result["loss"] = {name: step(kernels)[1] for name, kernels in arms.items()}
    use(PLATFORM)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curated", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--tasks", nargs="+", default=["seg", "normal", "pointmap"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each demo training slot runs
    config = load_config(args.config)
    out = {"threads": 1, "batch_size": args.batch_size, "repeats": args.repeats}
    for task_name in args.tasks:
        out[task_name] = measure(config, args.curated, task_name, args.repeats, args.batch_size)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
