"""The curation report: a Markdown page next to the manifest that says what went and why.

Counts per stage (how many entered, how many it dropped), reject reasons with an example
detail, score histograms of kept against rejected images, thumbnails of rejected images per
reason and, when balancing ran, leaf-cluster sizes before and after sampling. Plots are PNG
files under ``report/`` drawn with matplotlib's object API (no pyplot global state, so it is
safe inside a Dagster or worker process).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sapiens2.curation.config import CurationConfig
from sapiens2.data.decode import decode_image
from sapiens2.curation.registry import STAGES

# Score columns not worth a histogram: identifiers, hashes and the raw size (short_side says it).
_NOT_PLOTTED = {"phash", "sha256", "width", "height"}
_THUMBS_PER_REASON = 8
_THUMB_SIDE = 96


def stage_counts(manifest: pd.DataFrame, config: CurationConfig) -> pd.DataFrame:
    """One row per stage in run order: images entering it and images it removed (with reason)."""
    steps = [("decode", "unreadable")]
    steps += [(name, STAGES[name].reason) for name in config.stages]
    steps += [("dedup", "duplicate"), ("balance", "over_represented")]
    entering, table = len(manifest), []
    for stage, reason in steps:
        removed = int((manifest["reason"] == reason).sum()) if reason else 0
        table.append({"stage": stage, "reason": reason or "-", "entered": entering, "removed": removed})
        entering -= removed
    table.append({"stage": "kept", "reason": "-", "entered": entering, "removed": 0})
    return pd.DataFrame(table)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=90, metadata={"Software": None})


def histogram_columns(manifest: pd.DataFrame, config: CurationConfig) -> list[str]:
    """The numeric score columns of the configured stages, in run order, that hold any value."""
    columns = dict.fromkeys(c for name in config.stages for c in STAGES[name].columns if c not in _NOT_PLOTTED)
    return [c for c in columns if c in manifest and pd.api.types.is_numeric_dtype(manifest[c])
            and manifest[c].notna().any()]


def _histograms(manifest: pd.DataFrame, columns: list[str], path: Path) -> bool:
    if not columns:
        return False
    ncols = min(4, len(columns))
    nrows = -(-len(columns) // ncols)
    fig = Figure(figsize=(3.2 * ncols, 2.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(columns):]:
        ax.axis("off")
    for ax, col in zip(axes, columns):
        values = manifest[col].astype(float)
        edges = np.histogram_bin_edges(values.dropna(), bins=20)
        for status, colour in (("kept", "tab:green"), ("rejected", "tab:red")):
            ax.hist(values[manifest["status"] == status].dropna(), bins=edges, alpha=0.6, color=colour, label=status)
        ax.set_title(col, fontsize=9)
    fig.axes[0].legend(fontsize=8)
    _save(fig, path)
    return True


def _thumbnail(data: bytes) -> np.ndarray | None:
    image = decode_image(data, 64_000_000, _THUMB_SIDE).image
    if image is None:
        return None
    factor = _THUMB_SIDE / max(image.shape[:2])
    return cv2.resize(image, (max(1, round(image.shape[1] * factor)), max(1, round(image.shape[0] * factor))),
                      interpolation=cv2.INTER_AREA)


def _thumbnails(rows: pd.DataFrame, read: Callable[[list[str]], list[bytes]], path: Path) -> bool:
    thumbs = [(image_id, t) for image_id, data in zip(rows["id"], read(list(rows["source_path"])))
              if (t := _thumbnail(data)) is not None]
    if not thumbs:
        return False
    fig = Figure(figsize=(1.4 * len(thumbs), 1.7), layout="constrained")
    for ax, (image_id, thumb) in zip(fig.subplots(1, len(thumbs), squeeze=False)[0], thumbs):
        ax.imshow(thumb)
        ax.set_title(image_id, fontsize=6)
        ax.axis("off")
    _save(fig, path)
    return True


def _cluster_plot(sizes: dict[str, list[int]], path: Path) -> None:
    before, after, top = (np.asarray(sizes[k]) for k in ("before", "after", "top_of_leaf"))
    order = np.lexsort((np.arange(len(top)), top))
    fig = Figure(figsize=(max(4.0, 0.35 * len(order)), 2.8), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(order))
    ax.bar(x - 0.2, before[order], width=0.4, label="before", color="tab:grey")
    ax.bar(x + 0.2, after[order], width=0.4, label="after", color="tab:blue")
    ax.set_xticks(x, [f"{top[c]}/{c}" for c in order], fontsize=6, rotation=90)
    ax.set_xlabel("top cluster / leaf cluster")
    ax.set_ylabel("images")
    ax.legend(fontsize=8)
    _save(fig, path)


def write_report(manifest: pd.DataFrame, read: Callable[[list[str]], list[bytes]], output_dir: Path,
                 config: CurationConfig, cluster_sizes: dict[str, list[int]] | None = None) -> Path:
    """Write ``output_dir/report.md`` (and ``output_dir/report/*.png``); returns its path.

    ``read`` maps source paths to the files' bytes (``PoolShards.read``), for the thumbnails.
    """
    assets = output_dir / "report"
    shutil.rmtree(assets, ignore_errors=True)
    assets.mkdir(parents=True)
    counts = manifest["status"].value_counts()
    lines = ["# Curation report", "",
             f"{len(manifest)} inputs: " + ", ".join(f"{s} {int(counts.get(s, 0))}"
                                                     for s in ("kept", "rejected", "quarantined")), "",
             f"Stages in order: {', '.join(config.stages)}", "", "## Counts per stage", "",
             stage_counts(manifest, config).to_markdown(index=False), "", "## Reject reasons", ""]
    gone = manifest[manifest["reason"].notna()]
    if gone.empty:
        lines.append("Nothing was rejected.")
    else:
        reasons = gone.groupby("reason", sort=True).agg(images=("id", "size"), example=("detail", "first"))
        lines.append(reasons.reset_index().to_markdown(index=False))
    if _histograms(manifest, histogram_columns(manifest, config), assets / "scores.png"):
        lines += ["", "## Score histograms (kept vs rejected)", "", "![scores](report/scores.png)"]
    lines += ["", "## Rejected examples per reason"]
    for reason, rows in gone.sort_values("id").groupby("reason", sort=True):
        sample = rows.head(_THUMBS_PER_REASON)
        lines += ["", f"### {reason} ({len(rows)})", ""]
        if _thumbnails(sample, read, assets / f"rejected_{reason}.png"):
            lines.append(f"![{reason}](report/rejected_{reason}.png)")
        else:
            lines.append("Not decodable: " + ", ".join(f"`{i}`" for i in sample["id"]))
    if cluster_sizes is not None:
        _cluster_plot(cluster_sizes, assets / "clusters.png")
        sizes = pd.DataFrame({"leaf": range(len(cluster_sizes["before"])), "top": cluster_sizes["top_of_leaf"],
                              "before": cluster_sizes["before"], "after": cluster_sizes["after"]})
        lines += ["", "## Cluster balance", "", "![clusters](report/clusters.png)", "",
                  sizes.to_markdown(index=False)]
    report = output_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report
