"""The platform's typed configuration: one frozen model composed of one section per stage.

`params.yaml` at the project root holds the embedded defaults (the demo recipe); Dagster's
launchpad, the CLI and `dvc repro` all resolve to a `PlatformConfig` through `load_config`, so a
bad value fails on construction, before any work starts, with the file and the dotted field name.
The training steps' sections live in `config_sections`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pipelines.common.config_sections import FinetuneConfig, PretrainConfig, check_task_names
from sapiens2.config_section import ConfigSection
from sapiens2.curation.config import CurationConfig
from sapiens2.model.config import ARCHS
from sapiens2.tasks.registry import TASK_NAMES  # noqa: F401 - one definition, re-exported for the steps

if TYPE_CHECKING:
    from sapiens2.tasks import Task


class SynthConfig(ConfigSection):
    """The synthetic web pool standing in for a raw image pool."""

    n_people: int = Field(1200, ge=1, description="person renders; distractors are added on top")
    seed: int = 0
    workers: int = Field(2, ge=1)


# How much a fine-tuned model must beat its gate baseline by, in each task's primary-metric units:
# pose AP, seg mIoU, normal angular error (deg), pointmap canonical L2, albedo PSNR (dB).
DEFAULT_GATE_MARGIN = {"pose": 0.02, "seg": 0.02, "normal": 1.0, "pointmap": 0.01, "albedo": 0.5}


class EvaluateConfig(ConfigSection):
    """Held-out evaluation and its gate: a model passes when it beats the gate baseline (the
    strongest trivial baseline, or its untrained head) by at least the task's margin."""

    batch_size: int = Field(16, ge=1)
    flip_test: bool = True
    num_visualisations: int = Field(8, ge=0)
    gate_baseline: Literal["trivial", "untrained_head"] = Field(
        "trivial", description="what the gate compares with: the strongest trivial baseline or the untrained head"
    )
    gate_margin: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_GATE_MARGIN),
        description="per-task improvement the gate requires, in primary-metric units (direction-aware); "
                    "tasks left out keep their default",
    )

    @field_validator("gate_margin")
    @classmethod
    def _margins_for_tasks(cls, margins: dict[str, float]) -> dict[str, float]:
        check_task_names(margins)
        negative = {task: m for task, m in margins.items() if m < 0}
        if negative:
            raise ValueError(f"margins must be >= 0 (a margin is an improvement), got {negative}")
        return {**DEFAULT_GATE_MARGIN, **margins}


class RegistryConfig(ConfigSection):
    model_prefix: str = Field("sapiens2", min_length=1, description="registered name = <prefix>-<task>")


class PlatformConfig(ConfigSection):
    """Everything one end-to-end run needs; derived values come from methods, never mutation."""

    image_size: tuple[int, int] = (128, 96)
    # The keypoints the generator labels and pose trains on: the 17 COCO body points, or the
    # 308-point whole-body set of the reference models.
    keypoint_set: Literal["coco17", "sapiens308"] = "coco17"
    # Where the raw pool comes from: None renders the synthetic pool (`synth`); otherwise an
    # `s3://bucket/prefix` or a local folder holding `images/` (and `labels/<id>.npz` for the tasks).
    raw_source: str | None = None
    synth: SynthConfig = SynthConfig()
    curation: CurationConfig = CurationConfig()
    pretrain: PretrainConfig = PretrainConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    registry: RegistryConfig = RegistryConfig()

    @model_validator(mode="after")
    def _image_fits_patches(self) -> PlatformConfig:
        stride = ARCHS[self.pretrain.arch].token_stride  # the patch, or a 4K model's 4x4-patch window
        if any(side % stride for side in self.image_size):
            raise ValueError(f"image_size {self.image_size} must be a multiple of the {stride}-px token of {self.pretrain.arch}")
        return self

    def task_settings(self, name: str) -> dict[str, Any]:
        """Settings task `name` is built with (recorded in each model's model.json)."""
        settings = dict(self.finetune.task_settings.get(name, {}))
        if name == "pose":
            settings.setdefault("keypoint_set", self.keypoint_set)
        return settings

    def task(self, name: str) -> Task:
        """Task `name` with its configured settings: the one object training, evaluation and
        serving share, so a heatmap sigma or keypoint set cannot differ between them."""
        from sapiens2.tasks import get_task

        return get_task(name, **self.task_settings(name))

    def dataset_keypoints(self) -> dict[str, Any]:
        """CuratedDataset arguments for this keypoint set (label count and flip pairs)."""
        pose = self.task("pose")
        return {"num_keypoints": pose.num_keypoints, "flip_pairs": pose.flip_pairs}

    def model_name(self, task: str) -> str:
        return f"{self.registry.model_prefix}-{task}"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _describe(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors())


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML would keep the last)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in first_line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {first_line[key]})", key_node.start_mark)
        first_line[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: str | Path) -> Any:
    """The YAML document in `path`; a syntax error or a duplicate key is a ValueError naming the
    file, the line and the column."""
    try:
        return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"{where}: {err.problem}") from err


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PlatformConfig:
    """Read `path` (YAML) and apply dotted-key `overrides` such as {"pretrain.deepspeed.zero_stage": 3}.

    Raises ValueError naming the file and each offending field.
    """
    data: dict[str, Any] = {}
    source = str(path) if path is not None else "<defaults>"
    if path is not None:
        loaded = read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{source}: expected a mapping at the top level, got {type(loaded).__name__}")
        data = loaded or {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{source}: cannot override {dotted!r}: {key!r} is not a section")
        node[leaf] = value
    try:
        return PlatformConfig.model_validate(data)
    except ValidationError as err:
        given = f" with overrides of {', '.join(sorted(overrides))}" if overrides else ""
        raise ValueError(f"{source}{given}: invalid config: {_describe(err)}") from err
