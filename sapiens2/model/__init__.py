"""Sapiens2 ViT backbone: size table, building blocks and checkpoint IO."""

from sapiens2.model.backbone import Sapiens2Backbone, build_backbone
from sapiens2.model.checkpoint import (
    CheckpointMismatchError,
    LoadReport,
    load_checkpoint,
    read_state_dict,
    save_checkpoint,
)
from sapiens2.model.config import ARCHS, BackboneConfig, resolve_config

__all__ = [
    "ARCHS",
    "BackboneConfig",
    "CheckpointMismatchError",
    "LoadReport",
    "Sapiens2Backbone",
    "build_backbone",
    "load_checkpoint",
    "read_state_dict",
    "resolve_config",
    "save_checkpoint",
]
