"""Pictures people would rather see than read: loss curves, MAE reconstructions, image grids.

Each function writes a PNG and returns its path; MLflow logs it as an artifact and Dagster shows
it as asset metadata.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sapiens2.data.normalize import IMAGE_MEAN, IMAGE_STD, normalize  # noqa: E402
from sapiens2.pretrain.mae import patchify, unpatchify  # noqa: E402


def loss_curves_png(history: dict[str, list[float]], path: Path, title: str) -> Path:
    """One panel per series (losses, monitors) against the optimizer step, five to a row."""
    cols = min(5, len(history))
    rows = -(-len(history) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(history):]:
        ax.axis("off")
    for ax, (name, values) in zip(axes.flat, history.items()):
        ax.plot(np.arange(1, len(values) + 1), values, lw=1)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def image_grid_png(rows: list[list[np.ndarray]], path: Path, row_titles: list[str] | None = None,
                   col_titles: list[str] | None = None) -> Path:
    """A grid of uint8 RGB images (rows x columns), drawn as one mosaic on one axes: a subplot per
    image cost 3 s of the demo's evaluation for its 200 images."""
    gap = 4
    n_rows, n_cols = len(rows), max(len(r) for r in rows)
    cell_h = max(image.shape[0] for row in rows for image in row)
    cell_w = max(image.shape[1] for row in rows for image in row)
    mosaic = np.full((n_rows * (cell_h + gap) - gap, n_cols * (cell_w + gap) - gap, 3), 255, dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            top, left = r * (cell_h + gap), c * (cell_w + gap)
            mosaic[top:top + image.shape[0], left:left + image.shape[1]] = image[..., :3]
    fig, ax = plt.subplots(figsize=(1.6 * n_cols, 2.1 * n_rows))
    ax.imshow(mosaic, interpolation="nearest")
    ax.axis("off")
    for c, title in enumerate((col_titles or [])[:n_cols]):
        ax.text(c * (cell_w + gap) + cell_w / 2, -gap, title, ha="center", va="bottom", fontsize=8)
    for r, title in enumerate((row_titles or [])[:n_rows]):
        ax.text(-gap, r * (cell_h + gap) + cell_h / 2, title, rotation=90, ha="right", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _to_uint8(pixels: torch.Tensor) -> np.ndarray:
    return pixels.clamp(0, 255).byte().permute(1, 2, 0).numpy()


@torch.no_grad()
def mae_reconstruction_png(
    student: torch.nn.Module, images: np.ndarray, view: tuple[torch.Tensor, torch.Tensor, bool], path: Path,
    target: str = "normalized",
) -> Path:
    """Original | masked input | reconstruction (predicted patches pasted into the visible ones).

    ``view`` is the recipe's ``reconstruction_view``: the visible and hidden cells and whether the
    encoder sees positions (the masked view does, the position branch's pass does not).
    ``target`` is the objective's ``mae_target``: "normalized" predictions are shown with their
    original patch's mean and std, "pixels" ones through the dataset mean and std.
    """
    student.eval()
    keep, masked, positions = view
    pixels = torch.as_tensor(images).permute(0, 3, 1, 2).float()
    x = normalize(pixels)
    backbone = student.backbone
    patch = backbone.patch_size
    grid = (x.shape[-2] // patch, x.shape[-1] // patch)
    tokens = backbone.forward_tokens(x, keep, positions=positions)
    pred = student.mae_decoder(tokens, keep, masked, grid).float()
    patches = patchify(pixels, patch)
    mean, std = patches.mean(-1, keepdim=True), patches.std(-1, keepdim=True, unbiased=False)
    index = masked[..., None].expand(-1, -1, patches.shape[-1])
    recon = patches.clone()
    if target == "pixels":
        def per_channel(values: tuple[float, ...]) -> torch.Tensor:  # one patch's (D,) layout of a per-channel value
            return patchify(torch.ones_like(pixels[:1]) * pixels.new_tensor(values).view(1, 3, 1, 1), patch)[0, 0]

        restored = pred * per_channel(IMAGE_STD) + per_channel(IMAGE_MEAN)
    else:
        restored = pred * std.gather(1, masked[..., None]) + mean.gather(1, masked[..., None])
    recon.scatter_(1, index, restored)
    hidden = patches.clone()
    hidden.scatter_(1, index, torch.full_like(pred, 127.0))
    rows = [
        [_to_uint8(pixels[i]), _to_uint8(unpatchify(hidden, grid, patch)[i]), _to_uint8(unpatchify(recon, grid, patch)[i])]
        for i in range(len(images))
    ]
    share = masked.shape[1] / (masked.shape[1] + keep.shape[1])
    return image_grid_png(rows, path, col_titles=["image", f"masked {share:.0%}", "reconstruction"])


def curation_scores_png(manifest, path: Path) -> Path:
    """Histograms of the curation scores, kept vs rejected, plus the reject-reason counts."""
    scores = [c for c in ("short_side", "sharpness", "brightness", "person_score", "text_score") if c in manifest.columns]
    fig, axes = plt.subplots(1, len(scores) + 1, figsize=(3.2 * (len(scores) + 1), 3), squeeze=False)
    for ax, column in zip(axes[0], scores):
        for status in ("kept", "rejected"):
            values = manifest.loc[manifest["status"] == status, column].dropna().astype(float)
            if len(values):
                ax.hist(values, bins=30, alpha=0.6, label=status)
        ax.set_title(column, fontsize=9)
        ax.legend(fontsize=7)
    reasons = manifest["reason"].fillna("kept").value_counts()
    axes[0][-1].barh(reasons.index.astype(str), reasons.values)
    axes[0][-1].set_title("outcome", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
