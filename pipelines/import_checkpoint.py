"""`sapiens2 import-checkpoint PATH [--arch NAME] [--output FILE.safetensors]`.

Checks a published Sapiens2 backbone checkpoint (.safetensors, or .pth/.pt/.bin read with
`weights_only=True`, optionally wrapped in `state_dict`/`model`/`teacher`) against our backbone,
name by name and shape by shape, prints what it found, and with `--output` writes it as
safetensors for `finetune.init_checkpoint`. Exit status 1 with every offending key listed when
the checkpoint does not match.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

from sapiens2.model import ARCHS, CheckpointMismatchError, import_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 import-checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="reference-layout backbone checkpoint")
    parser.add_argument("--arch", choices=sorted(ARCHS), help="backbone size (default: inferred)")
    parser.add_argument("--output", type=Path, help="where to write the checked .safetensors copy")
    args = parser.parse_args(argv)
    try:
        report = import_checkpoint(args.path, args.arch, args.output)
    except (CheckpointMismatchError, FileNotFoundError, ValueError, pickle.UnpicklingError) as err:
        print(f"sapiens2 import-checkpoint: {err}", file=sys.stderr)
        return 1
    print(report.summary())
    if report.output is not None:
        print(f"fine-tune from it: sapiens2 finetune ... --set finetune.init_checkpoint={report.output} "
              f"--set pretrain.arch={report.arch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
