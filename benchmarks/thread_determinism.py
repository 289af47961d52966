"""Does launching the same fine-tuning again give the same bytes, at one and at two threads?

Launches one `sapiens2 finetune` (from scratch, debug model, rendered people) `--launches` times
at each intra-op thread count (`OMP_NUM_THREADS`, which every launch's `threads_per_rank` obeys),
one launch at a time, and prints one JSON object: per thread count, how many distinct weight
files and loss curves the launches wrote. One distinct file per count means launches at that
count are reproducible; the tests that compare two routes' bytes run at a count that is.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_curated  # noqa: E402 - the rendered, labelled folder the tests fine-tune on


def _launch(work: Path, curated: Path, task: str, steps: int, threads: int, index: int) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(OMP_NUM_THREADS=str(threads), SAPIENS2_TRAINING_SLOTS="1", SAPIENS2_WORKSPACE=str(work))
    out = work / f"{task}-{threads}t-{index}"
    command = [sys.executable, "-m", "pipelines.cli", "finetune", "--task", task, "--curated", str(curated),
               "--from-scratch", "--output", str(out), "--config", str(ROOT / "params.yaml"),
               "--set", "pretrain.arch=sapiens2_debug", "--set", "finetune.deepspeed.micro_batch_size=8",
               "--set", f"finetune.steps={steps}", "--set", f"finetune.task_steps.{task}={steps}",
               "--set", "finetune.optim.warmup_steps=2", "--set", f"finetune.checkpoint.every_n_steps={steps}"]
    with open(work / f"{out.name}.log", "w") as log:
        if subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{out.name} failed; see {log.name}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="pose")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--people", type=int, default=16)
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        curated = make_curated(work / "curated", args.people)
        for threads in args.threads:
            weights, curves = collections.Counter(), collections.Counter()
            for index in range(args.launches):
                out = _launch(work, curated, args.task, args.steps, threads, index)
                weights[hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:12]] += 1
                curves[json.dumps(json.loads((out / "history.json").read_text())["loss"])] += 1
                print(f"{threads} thread(s), launch {index + 1}/{args.launches}", file=sys.stderr, flush=True)
            results[str(threads)] = {"launches": args.launches, "distinct_weights": len(weights),
                                     "launches_per_weights": sorted(weights.values(), reverse=True),
                                     "weights_sha256": dict(weights.most_common()),
                                     "distinct_loss_curves": len(curves)}
    print(json.dumps({"settings": vars(args), "threads": results}, indent=2))


if __name__ == "__main__":
    main()
