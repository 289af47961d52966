"""The base of every typed config section: the library's (training, pretraining objective,
curation) and the platform's (`pipelines.common.config`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    """Immutable once validated (derived values come from methods, never mutation), and an
    unknown key is an error, so a misspelt setting fails instead of being ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")
