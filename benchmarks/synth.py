"""Benchmark the synthetic pool generator: 2,000 images at 128x96 with 2 workers.

Prints one JSON object. Wall time depends on whatever else runs on the machine, so the script
also measures the CPU time per pool image in one process (`cpu_ms_per_image`, files included)
and projects the 2-worker time on otherwise idle cores; `load_avg_1m` says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from sapiens2.data.synth import DistractorMix, generate_pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    mix = DistractorMix()
    people_share = 1.0 - sum(vars(mix).values())
    n_people = round(args.images * people_share)

    with tempfile.TemporaryDirectory() as out:
        sample = max(50, args.images // 10)
        start = time.process_time()
        generate_pool(out, round(sample * people_share), seed=1, height=args.height, width=args.width,
                      distractors=mix, workers=1, progress=False)
        cpu_ms = (time.process_time() - start) / sample * 1000

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        table = generate_pool(out, n_people, seed=0, height=args.height, width=args.width,
                              distractors=mix, workers=args.workers, progress=False)
        seconds = time.perf_counter() - start
    print(json.dumps({
        "images": len(table), "height": args.height, "width": args.width, "workers": args.workers,
        "seconds": round(seconds, 2), "images_per_s": round(len(table) / seconds, 1),
        "cpu_ms_per_image": round(cpu_ms, 2),
        "projected_idle_seconds": round(len(table) * cpu_ms / 1000 / args.workers, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
