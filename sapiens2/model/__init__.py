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
from sapiens2.model.importer import ImportReport, import_checkpoint, infer_arch, load_pretrained

__all__ = [
    "ARCHS",
    "BackboneConfig",
    "CheckpointMismatchError",
    "ImportReport",
    "LoadReport",
    "Sapiens2Backbone",
    "build_backbone",
    "import_checkpoint",
    "infer_arch",
    "load_checkpoint",
    "load_pretrained",
    "read_state_dict",
    "resolve_config",
    "save_checkpoint",
]
