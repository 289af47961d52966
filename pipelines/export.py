"""`sapiens2 export`: write a curated data set's labelled images in another label format."""

from __future__ import annotations

import argparse
from pathlib import Path

from sapiens2.data.formats import WRITERS
from sapiens2.data.formats.export import export_curated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sapiens2 export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--curated", type=Path, required=True, help="curated data set folder")
    parser.add_argument("--format", choices=sorted(WRITERS), required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--split", default=None, help="only this split (default: all kept rows)")
    args = parser.parse_args(argv)
    count = export_curated(args.curated, args.format, args.output, args.split)
    print(f"wrote {count} samples as {args.format} to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
