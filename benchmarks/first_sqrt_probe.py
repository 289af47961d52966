"""Where a two-thread launch stops repeating itself: the first `sqrt` after a model's forward.

`thread_determinism.py` shows that launches of the same fine-tune at two threads do not always
write the same weights. This probe narrows that to one operation. Each fresh process builds the
normal model of that benchmark (debug backbone, fixed seed), runs one forward pass at `--threads`
intra-op threads, then takes the square root of the same per-pixel squared lengths twice (the
first step of the normal loss's `unit_channels`). The input is identical in every process and
across the two calls; the two outputs should be too. Prints one JSON object: per process, how
many elements of the first call differ from the second, which index range, and by how many
units in the last place.

    python benchmarks/first_sqrt_probe.py --processes 10 --threads 2
    taskset -c 0 python benchmarks/first_sqrt_probe.py --processes 10 --threads 2   # one core
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def probe(curated: Path, threads: int) -> dict:
    """One forward pass, then sqrt twice on identical input; how far apart the two results are."""
    import torch

    from pipelines.common.config import load_config
    from pipelines.common.task_models import initial_model
    from sapiens2.data.dataset import CuratedDataset, collate

    torch.set_num_threads(threads)
    config = load_config(ROOT / "params.yaml", {"pretrain.arch": "sapiens2_debug"})
    task = config.task("normal")
    height, width = config.image_size
    data = CuratedDataset(curated, "train", height, width, tasks=("normal",), seed=0, augment=None,
                          person_crop_padding=task.person_crop_padding)
    torch.manual_seed(0)
    model = initial_model(config, "normal", "scratch")
    with torch.no_grad():
        pred = model(collate([data[i % len(data)] for i in range(8)])["image"])
    squared_length = pred.square().sum(dim=1, keepdim=True).clamp_min(1e-12)
    first, second = squared_length.sqrt().flatten(), squared_length.sqrt().flatten()
    differ = (first != second).nonzero().flatten()
    ulps = (first[differ].view(torch.int32) - second[differ].view(torch.int32)).abs()
    return {"elements": first.numel(), "differing": len(differ),
            "index_range": [int(differ.min()), int(differ.max())] if len(differ) else None,
            "max_ulps": int(ulps.max()) if len(differ) else 0,
            "max_relative": float(((first - second).abs() / second).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--curated", type=Path, help="(internal) the rendered folder one process reads")
    args = parser.parse_args()
    if args.curated:
        print(json.dumps(probe(args.curated, args.threads)))
        return
    from tests.conftest import make_curated  # the rendered, labelled folder the tests fine-tune on

    with tempfile.TemporaryDirectory() as tmp:
        curated = make_curated(Path(tmp) / "curated", 16)
        runs = []
        for index in range(args.processes):
            out = subprocess.run([sys.executable, __file__, "--curated", str(curated), "--threads", str(args.threads)],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(f"process {index + 1}/{args.processes}", file=sys.stderr, flush=True)
    print(json.dumps({"settings": {"processes": args.processes, "threads": args.threads},
                      "processes_with_a_differing_first_sqrt": sum(r["differing"] > 0 for r in runs),
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
