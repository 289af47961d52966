"""Training engine: typed configs -> DeepSpeed ZeRO engine, schedules, layer-wise lr decay,
resumable checkpoints. `engine` and `checkpoint` import DeepSpeed; import them by module path
(`from sapiens2.train.engine import initialize`) so config-only users stay light.
"""

import os

import torch

# DeepSpeed picks its accelerator at import; choose the CPU one explicitly on a machine without
# CUDA (before any module of this package imports deepspeed) to skip auto-detection and its warning.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from sapiens2.train.config import CheckpointSection, DeepSpeedSection, OptimSection  # noqa: E402
from sapiens2.train.lr_decay import layerwise_param_groups  # noqa: E402
from sapiens2.train.schedules import cosine_momentum, lr_schedule, warmup_cosine, warmup_linear_decay  # noqa: E402

__all__ = [
    "CheckpointSection",
    "DeepSpeedSection",
    "OptimSection",
    "cosine_momentum",
    "layerwise_param_groups",
    "lr_schedule",
    "warmup_cosine",
    "warmup_linear_decay",
]
