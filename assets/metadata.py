"""Dagster metadata helpers: pictures and tables shown on an asset's page."""


import base64
from pathlib import Path

import dagster as dg
import pandas as pd


def image(path: Path, alt: str = "") -> dg.MetadataValue:
    """A PNG shown inline on the asset page (markdown with a data URI)."""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return dg.MetadataValue.md(f"![{alt}](data:image/png;base64,{data})")


def table(frame: pd.DataFrame) -> dg.MetadataValue:
    return dg.MetadataValue.md(frame.to_markdown(index=False))
