"""The prediction grid: ragged rows and mixed cell sizes in one mosaic, every image drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from pipelines.common.plots import image_grid_png


def test_image_grid_draws_every_cell_of_ragged_rows(tmp_path: Path) -> None:
    red = np.zeros((32, 24, 3), np.uint8)
    red[..., 0] = 255
    blue = np.zeros((16, 24, 3), np.uint8)  # smaller than the cell: padded, not stretched
    blue[..., 2] = 255
    green = np.zeros((32, 24, 4), np.uint8)  # RGBA: the alpha channel is dropped
    green[..., 1] = 255
    path = image_grid_png([[red, blue], [green]], tmp_path / "grid.png", row_titles=["a", "b"], col_titles=["x", "y"])
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    assert Image.open(path).size == (2 * 160, 2 * 210)  # the figure's size per cell, as before
    for colour in ((255, 0, 0), (0, 0, 255), (0, 255, 0)):
        assert (pixels == colour).all(axis=1).sum() > 100, colour
