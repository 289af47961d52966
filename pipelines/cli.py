"""`sapiens2 <verb>`: one verb per pipeline step, each handled by that step's own `main(argv)`."""

from __future__ import annotations

import importlib
import sys

VERBS = {
    "synth": ("pipelines.synth", "generate the synthetic web pool (people + distractors)"),
    "curate": ("pipelines.curate", "filter, dedup and split a raw image pool into a curated dataset"),
    "validate": ("pipelines.validate", "run the great-expectations suites on a curated dataset"),
    "pretrain": ("pipelines.pretrain", "pretrain the backbone (MAE + self-distillation) under DeepSpeed"),
    "finetune": ("pipelines.finetune", "fine-tune one task head on the pretrained backbone"),
    "import-checkpoint": ("pipelines.import_checkpoint", "check a published backbone checkpoint and save it for fine-tuning"),
    "evaluate": ("pipelines.evaluate", "evaluate the five task models on the held-out split"),
    "register": ("pipelines.register", "register the task models in MLflow with lineage tags"),
    "promote": ("pipelines.promote", "move the champion alias to a better model version"),
    "export": ("pipelines.export", "write a curated dataset as COCO keypoints, PNG label maps or the dense layout"),
    "predict": ("pipelines.predict", "run a task model on images; write overlays and raw outputs"),
    "demo": ("assets.demo", "materialise the whole Dagster graph on the embedded defaults"),
}


def _usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: sapiens2 <verb> [options]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {text}" for verb, (_, text) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"sapiens2: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
