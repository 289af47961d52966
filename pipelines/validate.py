"""Data-quality gates for a curated dataset, written as great-expectations suites.

Three kinds of table are validated:
- the curation manifest (`manifest.parquet`, one row per input file),
- a one-row count table tying the manifest to the files on disk (`build_counts`),
- one per-image statistics table per task (`build_label_manifests`, recomputed from the label
  files; the curation step writes the same tables as `labels/<task>.parquet`, validation writes
  nothing into the dataset it checks); both builders live in `pipelines.common.dataset_stats`.

`validate_curated` returns one `SuiteResult` per suite; the Dagster asset checks block on
`success` and the failed expectations become check metadata and MLflow tags.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pipelines.common.dataset_stats import (
    NUM_KEYPOINTS,
    NUM_SEG_CLASSES,
    TASKS,
    build_counts,
    build_label_manifests,
)
from pipelines.common.config import load_config
from pipelines.common.workspace import Workspace

# GX sends usage analytics unless this is off, and reads the flag when it is imported.
os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
import great_expectations as gx  # noqa: E402
import great_expectations.expectations as gxe  # noqa: E402
from great_expectations.data_context.types.base import ProgressBarsConfig  # noqa: E402
from great_expectations.expectations.row_conditions import Column  # noqa: E402

from sapiens2.curation.filters import REASONS  # noqa: E402

STATUSES = ("kept", "rejected", "quarantined")
SPLITS = ("train", "val")
# float16 storage of unit normals keeps |n| within ~1e-3 of 1; 1e-2 catches unnormalised data.
NORMAL_NORM_TOL = 1e-2
MAX_REPROJECTION_PX = 1.0
MAX_DEPTH_M = 100.0


@dataclass(frozen=True)
class FailedExpectation:
    """One expectation that did not hold: its type, column(s), what was observed and the ids
    of (up to 20) offending rows when the table has an `id` column."""

    expectation_type: str
    column: str | None
    observed: str
    ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SuiteResult:
    """Outcome of one expectation suite against one table."""

    suite: str
    success: bool
    evaluated: int
    failed: list[FailedExpectation] = field(default_factory=list)


def _between(column: str, lo=None, hi=None, **kw) -> gxe.Expectation:
    return gxe.ExpectColumnValuesToBeBetween(column=column, min_value=lo, max_value=hi, **kw)


def _id_rules() -> list[gxe.Expectation]:
    return [gxe.ExpectColumnValuesToNotBeNull(column="id"), gxe.ExpectColumnValuesToBeUnique(column="id")]


def curated_suite() -> gx.ExpectationSuite:
    """Expectations on `manifest.parquet`: schema, statuses, reasons, splits, score ranges."""
    columns = ["id", "path", "status", "reason", "width", "height", "short_side", "sharpness",
               "brightness", "clipped_fraction", "person_score", "num_persons", "text_score",
               "phash", "dup_group", "split"]
    kept = {"row_condition": Column("status") == "kept"}
    not_kept = {"row_condition": Column("status") != "kept"}
    expectations = [
        gxe.ExpectTableColumnsToMatchSet(column_set=columns, exact_match=False),
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        *_id_rules(),
        gxe.ExpectColumnValuesToNotBeNull(column="path"),
        gxe.ExpectColumnValuesToBeUnique(column="path"),
        gxe.ExpectColumnValuesToBeInSet(column="status", value_set=list(STATUSES)),
        gxe.ExpectColumnValuesToNotBeNull(column="status"),
        gxe.ExpectColumnValuesToBeInSet(column="reason", value_set=list(REASONS)),
        gxe.ExpectColumnValuesToBeNull(column="reason", **kept),
        gxe.ExpectColumnValuesToNotBeNull(column="reason", **not_kept),
        gxe.ExpectColumnValuesToBeInSet(column="split", value_set=list(SPLITS), **kept),
        gxe.ExpectColumnValuesToNotBeNull(column="split", **kept),
        gxe.ExpectColumnValuesToBeNull(column="split", **not_kept),
        gxe.ExpectColumnDistinctValuesToContainSet(column="split", value_set=list(SPLITS), **kept),
        gxe.ExpectColumnValuesToNotBeNull(column="phash", **kept),
        gxe.ExpectColumnValuesToNotBeNull(column="dup_group",
                                          row_condition=Column("reason") == "duplicate"),
        _between("width", 1), _between("height", 1), _between("short_side", 1),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="width", column_B="short_side", or_equal=True),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="height", column_B="short_side", or_equal=True),
        _between("sharpness", 0), _between("brightness", 0, 255),
        _between("clipped_fraction", 0, 1), _between("person_score", 0),  # detector margin, unbounded above
        _between("num_persons", 0), _between("text_score", 0, 1),
        _between("num_persons", 1, **kept),
    ]
    return gx.ExpectationSuite(name="curated_manifest", expectations=expectations)


def counts_suite() -> gx.ExpectationSuite:
    """Expectations tying the manifest's counts to the images/ and labels/ folders."""
    return gx.ExpectationSuite(name="curated_counts", expectations=[
        _between("kept_rows", 1),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="kept_rows", column_B="image_files"),
        # Kept images without task labels still serve pretraining; tasks use the labelled ones.
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="kept_rows", column_B="label_files", or_equal=True,
                                                    ignore_row_if="either_value_is_missing"),
        _between("label_files", 1),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="manifest_rows", column_B="input_count",
                                            ignore_row_if="either_value_is_missing"),
    ])


def label_suites(num_keypoints: int = NUM_KEYPOINTS) -> dict[str, gx.ExpectationSuite]:
    """One suite per task over the statistics tables of `build_label_manifests`; pose labels must
    carry `num_keypoints` points (17 COCO or the 308-point whole-body set)."""
    rules = {
        "pose": [_between("num_keypoints", num_keypoints, num_keypoints),
                 _between("num_visible", 0, num_keypoints), _between("num_invalid_vis", 0, 0),
                 _between("num_out_of_bounds", 0, 0),
                 gxe.ExpectColumnMeanToBeBetween(column="num_visible", min_value=1)],
        "seg": [_between("class_min", 0, NUM_SEG_CLASSES - 1), _between("class_max", 0, NUM_SEG_CLASSES - 1),
                gxe.ExpectColumnValuesToBeInSet(column="shape_matches", value_set=[True]),
                _between("mask_agreement", 0.95, 1.0)],
        "normal": [_between("max_norm_error", 0, NORMAL_NORM_TOL), _between("nonzero_outside_mask", 0, 0),
                   _between("num_nonfinite", 0, 0),
                   gxe.ExpectColumnValuesToBeInSet(column="shape_matches", value_set=[True])],
        "pointmap": [_between("z_min", 0, MAX_DEPTH_M, strict_min=True), _between("z_max", 0, MAX_DEPTH_M),
                     gxe.ExpectColumnValuesToNotBeNull(column="z_min"),
                     _between("median_reprojection_px", 0, MAX_REPROJECTION_PX),
                     _between("nonzero_outside_mask", 0, 0),
                     gxe.ExpectColumnValuesToBeInSet(column="shape_matches", value_set=[True])],
        "albedo": [_between("albedo_min", 0, 255), _between("albedo_max", 1, 255),
                   gxe.ExpectColumnValuesToBeInSet(column="shape_matches", value_set=[True])],
    }
    return {task: gx.ExpectationSuite(
        name=f"labels_{task}",
        expectations=[gxe.ExpectTableRowCountToBeBetween(min_value=1), *_id_rules(), *rules[task]])
        for task in TASKS}


def _plain(value):
    """numpy scalars and nested sequences as plain Python values, for readable messages."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


def _error_messages(info) -> list[str]:
    """Exception messages from GX's exception_info: flat, or keyed by the failing metric."""
    if not info:
        return []
    if "raised_exception" in info:
        return [str(info["exception_message"])] if info["raised_exception"] else []
    return [m for sub in info.values() if isinstance(sub, dict) for m in _error_messages(sub)]


def _summarise(result) -> SuiteResult:
    failed = []
    for r in result.results:
        if r.success:
            continue
        cfg, res = r.expectation_config, r.result or {}
        column = cfg.kwargs.get("column") or ",".join(
            str(cfg.kwargs[k]) for k in ("column_A", "column_B") if k in cfg.kwargs) or None
        errors = _error_messages(r.exception_info)
        if errors:
            observed = "error: " + "; ".join(sorted(set(errors)))
        elif "observed_value" in res:
            observed = f"observed {_plain(res['observed_value'])!r}"
        else:
            examples = _plain(res.get("partial_unexpected_list", [])[:5])
            observed = (f"{res.get('unexpected_count')} unexpected of {res.get('element_count')}, "
                        f"e.g. {examples}")
        ids = [str(row["id"]) for row in res.get("partial_unexpected_index_list") or []
               if isinstance(row, dict) and "id" in row]
        failed.append(FailedExpectation(cfg.type, column, observed, ids))
    return SuiteResult(result.suite_name, bool(result.success), len(result.results), failed)


def run_suites(tables: dict[str, tuple[gx.ExpectationSuite, pd.DataFrame]]) -> list[SuiteResult]:
    """Validate each (suite, dataframe) pair in one ephemeral GX context."""
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas(name="curated")
    results = []
    for name, (suite, frame) in tables.items():
        batch_def = source.add_dataframe_asset(name=name).add_batch_definition_whole_dataframe(name)
        suite = context.suites.add(suite)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=name, data=batch_def, suite=suite))
        result_format = {"result_format": "SUMMARY"}
        if "id" in frame.columns:
            result_format["unexpected_index_column_names"] = ["id"]
        results.append(_summarise(definition.run(batch_parameters={"dataframe": frame},
                                                 result_format=result_format)))
    return results


def validate_curated(curated_dir: str | Path, input_count: int | None = None,
                     num_keypoints: int = NUM_KEYPOINTS) -> list[SuiteResult]:
    """Run every suite against a curated dataset (label suites only when labels/ exists)."""
    curated_dir = Path(curated_dir)
    tables = {
        "curated_manifest": (curated_suite(), pd.read_parquet(curated_dir / "manifest.parquet")),
        "curated_counts": (counts_suite(), build_counts(curated_dir, input_count)),
    }
    if (curated_dir / "labels").is_dir():
        suites = label_suites(num_keypoints)
        for task, frame in build_label_manifests(curated_dir).items():
            tables[f"labels_{task}"] = (suites[task], frame)
    return run_suites(tables)


def main(argv: list[str] | None = None) -> int:
    """CLI: `sapiens2 validate [--curated DIR]`; exit status 1 when any suite fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curated", type=Path, default=None,
                        help="curated dataset folder (default: the workspace's data/curated)")
    parser.add_argument("--input-count", type=int, default=None, help="files that entered curation")
    parser.add_argument("--config", type=Path, default=None, help="platform config (default: the workspace's params.yaml)")
    args = parser.parse_args(argv)
    ws = Workspace.from_env()
    config = load_config(args.config or ws.params_file)
    results = validate_curated(args.curated or ws.curated_dir, args.input_count, config.task("pose").num_keypoints)
    for res in results:
        print(f"{'PASS' if res.success else 'FAIL'} {res.suite} ({res.evaluated} expectations)")
        for f in res.failed:
            ids = f" ids {f.ids[:5]}" if f.ids else ""
            print(f"    {f.expectation_type} [{f.column}]: {f.observed}{ids}")
    return 0 if all(r.success for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
