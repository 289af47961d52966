"""What every task provides, and the summed-statistics metric most of them share.

A task bundles the five parts the platform needs for one output type (STYLE rule 2): head wiring,
loss, targets/codec, metric and visualisation. Tasks are frozen dataclasses so their settings are
typed, validated once and safe to share between the trainer and the evaluator.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

SCALES = ("tiny", "reference")


@runtime_checkable
class Metric(Protocol):
    """Accumulates sufficient statistics so results merge exactly across batches and ranks."""

    def update(self, pred: Any, batch: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def merge(self, other: Metric) -> Metric: ...

    def compute(self) -> dict[str, float]: ...


class SummedStateMetric:
    """Metric whose state is a dict of numpy arrays that add up across batches and ranks.

    Subclasses define `_empty_state()` and `compute()`, and add into `self.state` in `update()`.
    Because every statistic is a sum (or a histogram), `merge` is exact: merging two halves of a
    data set gives the same state as one pass over the whole.
    """

    def __init__(self) -> None:
        self.state: dict[str, np.ndarray] = self._empty_state()

    def _empty_state(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        empty = self._empty_state()
        if set(state) != set(empty):
            raise ValueError(f"metric state keys {sorted(state)} != expected {sorted(empty)}")
        self.state = {k: np.asarray(state[k], dtype=empty[k].dtype).copy() for k in empty}

    def merge(self, other: SummedStateMetric) -> SummedStateMetric:
        for key, value in other.state_dict().items():
            self.state[key] = self.state[key] + value
        return self


def check_scale(scale: str) -> str:
    if scale not in SCALES:
        raise ValueError(f"unknown head scale {scale!r}; expected one of {SCALES}")
    return scale


class Task(abc.ABC):
    """The interface of a task; concrete tasks are frozen dataclasses holding their settings."""

    name: ClassVar[str]
    primary_metric: ClassVar[str]
    higher_is_better: ClassVar[bool]
    # Top-down tasks see the person box (padded by this factor) as their whole input; None: the image.
    person_crop_padding: float | None = None

    @abc.abstractmethod
    def build_head(self, embed_dim: int, scale: str) -> nn.Module:
        """Head taking the backbone feature map (B, embed_dim, h, w)."""

    @abc.abstractmethod
    def loss(self, pred: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Total loss and a log of its named terms (unweighted) plus `loss` (weighted total)."""

    @abc.abstractmethod
    def metric(self) -> Metric:
        """A fresh metric accumulator."""

    @abc.abstractmethod
    def decode(self, pred: Any) -> list[Any]:
        """Per-image numpy outputs from a batched prediction."""

    @abc.abstractmethod
    def decode_labels(self, batch: dict[str, Any]) -> list[Any]:
        """Per-image labels of a collated batch in `decode`'s form, so that `visualize` draws the
        ground truth as it draws a prediction (the prediction grid's "label" column)."""

    @abc.abstractmethod
    def visualize(self, image_uint8: np.ndarray, output: Any) -> np.ndarray:
        """uint8 RGB picture of one decoded output, the size of the image."""

    def with_label_statistics(self, samples: Any) -> Task:
        """The task with any setting that is fitted to the training labels (an iterable of
        samples) resolved; most tasks have none and return themselves."""
        return self

    def initialise_head(self, head: nn.Module) -> None:
        """Give a freshly built head what it starts from that `with_label_statistics` fitted
        (the pointmap's prior map); most tasks have nothing to give."""

    @torch.no_grad()
    def predict(self, model: nn.Module, images: torch.Tensor) -> Any:
        """Inference-time prediction; tasks with test-time augmentation override this."""
        return model(images)


def masked_label_maps(batch: dict[str, Any], field: str) -> list[np.ndarray]:
    """Per-image (H, W, C) float32 maps of a collated batch's (B, C, H, W) label `field`, zero off
    the mask, where nothing is scored: `decode_labels` of the dense tasks."""
    maps = batch[field].detach().float() * batch["mask"][:, None]
    return list(maps.permute(0, 2, 3, 1).cpu().numpy())


def weighted_items(
    terms: dict[str, tuple[float, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum weighted loss terms; the log holds each unweighted term and the weighted total."""
    total = sum(weight * value for weight, value in terms.values())
    log = {name: float(value.detach()) for name, (_, value) in terms.items()}
    log["loss"] = float(total.detach())
    return total, log
