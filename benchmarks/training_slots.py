"""Two training programs at once on half the cores each, or one after the other on all of them?

Fine-tunes two tasks of the demo recipe from scratch with the platform's own `sapiens2 finetune`
(DeepSpeed, one rank) on rendered people (their train split): first one after the other with every core
(`SAPIENS2_TRAINING_SLOTS=1`), then both at once with half the cores each (the default, 2).
Prints one JSON object with the wall time of each layout and their ratio (concurrent /
sequential, below 1 when two slots win); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_curated  # noqa: E402 - the rendered, labelled folder the tests fine-tune on


def _finetune(work: Path, curated: Path, task: str, steps: int, slots: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MLFLOW_TRACKING_URI")}
    env.update(SAPIENS2_TRAINING_SLOTS=str(slots), SAPIENS2_WORKSPACE=str(work))
    command = [sys.executable, "-m", "pipelines.cli", "finetune", "--task", task, "--curated", str(curated),
               "--from-scratch", "--output", str(work / f"{task}-{slots}-{steps}"), "--config", str(ROOT / "params.yaml"),
               "--set", f"finetune.steps={steps}", "--set", f"finetune.task_steps.{task}={steps}",
               "--set", f"finetune.checkpoint.every_n_steps={steps}"]
    log = open(work / f"{task}-{slots}-{steps}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"{' '.join(proc.args[3:6])} failed (exit {proc.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs=2, default=["seg", "normal"])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--people", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        curated = make_curated(work / "curated", args.people)
        # A first start pays for cold caches (and DeepSpeed's op build): not part of either layout.
        _wait([_finetune(work, curated, args.tasks[0], 25, slots=1)])
        started = time.perf_counter()
        for task in args.tasks:
            _wait([_finetune(work, curated, task, args.steps, slots=1)])
        sequential = time.perf_counter() - started
        started = time.perf_counter()
        _wait([_finetune(work, curated, task, args.steps, slots=2) for task in args.tasks])
        concurrent = time.perf_counter() - started
    print(json.dumps({"tasks": args.tasks, "steps": args.steps, "cores": os.cpu_count(),
                      "sequential_all_cores_s": round(sequential, 1), "concurrent_half_cores_s": round(concurrent, 1),
                      "concurrent_over_sequential": round(concurrent / sequential, 3)}, indent=2))


if __name__ == "__main__":
    main()
