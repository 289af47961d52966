"""Benchmark one backbone size: inference, a full-token training step and an MAE step.

Prints one JSON object: forward (inference) and forward+backward time per image and images/s
for --arch at --img-size, --batch and --dtype, and the MAE step at --mask-ratio (the encoder sees
only the visible tokens through `forward_tokens(images, keep_idx)`) beside the full-token step,
with their ratio. The two training steps alternate within one loop, so a machine whose load
changes during the run slows both alike and the ratio stays meaningful; times are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from sapiens2.model import ARCHS, build_backbone

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def per_image(seconds: float, batch: int) -> dict[str, float]:
    return {"ms_per_image": round(seconds / batch * 1000, 3), "images_per_s": round(batch / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sapiens2_tiny", choices=sorted(ARCHS))
    parser.add_argument("--img-size", type=int, nargs=2, default=(1024, 768), metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=10, help="timed iterations of each measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mask-ratio", type=float, default=0.75)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    backbone = build_backbone(args.arch, img_size=args.img_size).to(device)
    images = torch.randn(args.batch, 3, *args.img_size, device=device)
    grid = backbone.config.grid_size
    tokens = grid[0] * grid[1]
    visible = max(1, round(tokens * (1 - args.mask_ratio)))
    # Random patchwise masking: the step cost depends on how many tokens are visible, not where.
    keep = torch.rand(args.batch, tokens, device=device).argsort(dim=1)[:, :visible]
    dtype = DTYPES[args.dtype]
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()

    def forward() -> None:
        with torch.no_grad(), autocast:
            backbone(images)

    def step(keep_idx: torch.Tensor | None) -> Callable[[], None]:
        def run() -> None:
            backbone.zero_grad(set_to_none=True)
            with autocast:
                loss = backbone.forward_tokens(images, keep_idx).float().square().mean()
            loss.backward()
        return run

    backbone.eval()
    for _ in range(args.warmup):
        forward()
    inference = statistics.median(timed(forward, device) for _ in range(args.steps))

    backbone.train()
    full_step, mae_step = step(None), step(keep)
    for _ in range(args.warmup):
        full_step()
        mae_step()
    full, masked = [], []
    for _ in range(args.steps):
        full.append(timed(full_step, device))
        masked.append(timed(mae_step, device))
    full_s, masked_s = statistics.median(full), statistics.median(masked)

    print(json.dumps({
        "arch": args.arch, "img_size": list(args.img_size), "batch": args.batch, "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": sum(p.numel() for p in backbone.parameters()), "tokens": tokens, "steps": args.steps,
        "forward": per_image(inference, args.batch),
        "forward_backward": per_image(full_s, args.batch),
        "mae": {
            "mask_ratio": args.mask_ratio, "visible_tokens": visible,
            "step": per_image(masked_s, args.batch),
            "full_token_step": per_image(full_s, args.batch),
            "step_ratio": round(masked_s / full_s, 3),
        },
        "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
