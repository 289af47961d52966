"""The platform config: a bad value fails on load, naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.common.config import PlatformConfig, load_config
from pipelines.common.workspace import PROJECT_ROOT


def test_project_params_load_and_match_the_demo_recipe() -> None:
    config = load_config(PROJECT_ROOT / "params.yaml")
    assert config.pretrain.arch == "sapiens2_tiny"
    assert config.image_size == (128, 96)
    assert config.model_name("pose") == "sapiens2-pose"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"pretrain.arch": "sapiens2_7b"}, "pretrain.arch"),
        ({"pretrain.deepspeed.zero_stage": 4}, "pretrain.deepspeed.zero_stage"),
        ({"pretrain.steps": -5}, "pretrain.steps"),
        ({"finetune.steps": 0}, "finetune.steps"),
        ({"synth.n_people": 0}, "synth.n_people"),
        ({"image_size": [100, 96]}, "image_size"),
        ({"pretrain.arch": "sapiens2_tiny_4k"}, "image_size"),  # 96 px is not a multiple of its 64-px token
    ],
)
def test_bad_value_names_file_and_field(override: dict, field: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(PROJECT_ROOT / "params.yaml", override)
    message = str(err.value)
    assert "params.yaml" in message
    assert field.split(".")[0] in message
    assert field.split(".")[-1] in message or "image_size" in message


def test_unknown_field_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"pretrain": {"stepz": 3}}))
    with pytest.raises(ValueError, match=r"bad\.yaml.*pretrain\.stepz"):
        load_config(path)


def test_a_duplicate_key_names_the_file_the_key_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("pretrain:\n  steps: 10\n  seed: 1\n  steps: 20\n")
    with pytest.raises(ValueError, match=r"params.yaml:4:3: duplicate key 'steps' \(first on line 2\)"):
        load_config(path)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("finetune:\n  steps: 10\n bad: [1, 2\n")
    with pytest.raises(ValueError, match=r"params.yaml:3:"):
        load_config(path)


def test_warmup_longer_than_run_is_rejected() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        load_config(None, {"finetune.steps": 10, "finetune.optim.warmup_steps": 20})


def test_overrides_are_applied_and_typed() -> None:
    config = load_config(None, {"pretrain.deepspeed.zero_stage": 3, "finetune.init_checkpoint": "/x.safetensors"})
    assert isinstance(config, PlatformConfig)
    assert config.pretrain.deepspeed.zero_stage == 3
    assert config.pretrain.deepspeed.micro_batch_size == 8  # pretraining's default, not DeepSpeed's 1
    assert config.finetune.init_checkpoint == "/x.safetensors"
    with pytest.raises(ValueError, match="koleo_weight > 0 needs deepspeed.micro_batch_size >= 2"):
        load_config(None, {"pretrain.deepspeed.micro_batch_size": 1})


def test_task_settings_reach_the_task_and_unknown_ones_are_named() -> None:
    config = load_config(PROJECT_ROOT / "params.yaml", {"finetune.task_settings.pose.sigma": 2.5})
    assert config.task("pose").sigma == 2.5 and config.task("pose").num_keypoints == 17
    assert config.task("seg").name == "seg"
    whole_body = load_config(PROJECT_ROOT / "params.yaml", {"keypoint_set": "sapiens308"})
    assert whole_body.task("pose").num_keypoints == 308
    assert whole_body.dataset_keypoints()["num_keypoints"] == 308
    with pytest.raises(ValueError, match=r"finetune\.task_settings.*sigmaa"):
        load_config(PROJECT_ROOT / "params.yaml", {"finetune.task_settings.pose.sigmaa": 3.0})


def test_task_optim_overrides_one_tasks_optimizer_and_bad_overrides_are_named() -> None:
    config = load_config(PROJECT_ROOT / "params.yaml", {"finetune.task_optim": {"seg": {"lr": 0.002}}})
    assert config.finetune.optim_for("seg").lr == 0.002
    assert config.finetune.optim_for("seg").head_lr_scale == config.finetune.optim.head_lr_scale
    assert config.finetune.optim_for("normal") == config.finetune.optim
    for bad, named in [({"posse": {"lr": 0.1}}, "posse"), ({"seg": {"lrr": 0.1}}, "lrr"),
                       ({"seg": {"backbone_frozen_fraction": 1.5}}, "backbone_frozen_fraction"),
                       ({"seg": {"warmup_steps": 10_000}}, "warmup_steps")]:
        with pytest.raises(ValueError, match=rf"params\.yaml.*finetune(.|\n)*{named}"):
            load_config(PROJECT_ROOT / "params.yaml", {"finetune.task_optim": bad})


def test_augmentation_recipe_is_validated_and_off_by_default() -> None:
    assert load_config(PROJECT_ROOT / "params.yaml").finetune.augmentation() is None
    config = load_config(None, {"finetune.augment.affine_prob": 0.5, "finetune.augment.scale_range": [0.8, 1.2]})
    recipe = config.finetune.augmentation()
    assert recipe.affine_prob == 0.5 and recipe.scale_range == (0.8, 1.2)
    with pytest.raises(ValueError, match=r"finetune\.augment.*affine_prob"):
        load_config(None, {"finetune.augment.affine_prob": 1.5})
    with pytest.raises(ValueError, match=r"finetune\.augment.*rotation"):
        load_config(None, {"finetune.augment.rotation": 10})


def test_gate_defaults_and_margin_overrides() -> None:
    config = load_config(PROJECT_ROOT / "params.yaml")
    assert config.evaluate.gate_baseline == "trivial"
    assert config.evaluate.gate_margin == {"pose": 0.02, "seg": 0.02, "normal": 1.0, "pointmap": 0.01, "albedo": 0.5}
    relaxed = load_config(PROJECT_ROOT / "params.yaml", {"evaluate.gate_margin.pose": 0.0,
                                                         "evaluate.gate_baseline": "untrained_head"})
    assert relaxed.evaluate.gate_margin["pose"] == 0.0 and relaxed.evaluate.gate_margin["normal"] == 1.0
    assert relaxed.evaluate.gate_baseline == "untrained_head"
    for bad in ({"evaluate.gate_margin.depth": 0.1}, {"evaluate.gate_margin.seg": -0.1},
                {"evaluate.gate_baseline": "oracle"}):
        with pytest.raises(ValueError, match="evaluate"):
            load_config(PROJECT_ROOT / "params.yaml", bad)


def test_the_launchpad_offers_every_section_and_merges_nested_overrides() -> None:
    """Through Dagster's own schema: the `platform` resource lists every PlatformConfig field;
    a nested override changes only the keys it names; a bad one is named before any asset runs."""
    import dagster as dg

    from assets.resources import PlatformResource

    @dg.asset(required_resource_keys={"platform"})
    def probe(context):  # unannotated: this module defers annotations, Dagster resolves them
        return context.resources.platform.config.pretrain.deepspeed.zero_stage

    defs = dg.Definitions(assets=[probe], resources={"platform": PlatformResource()})
    schema = defs.resolve_implicit_global_asset_job_def().run_config_schema.config_type
    fields = schema.fields["resources"].config_type.fields["platform"].config_type.fields["config"].config_type.fields
    assert set(fields) == set(PlatformConfig.model_fields)
    overridden = PlatformResource(pretrain={"deepspeed": {"zero_stage": 3}}, finetune={"task_steps": {}}).resolve()
    defaults = load_config(PROJECT_ROOT / "params.yaml")
    assert overridden.pretrain.deepspeed.zero_stage == 3 and overridden.finetune.task_steps == {}
    assert overridden.pretrain.deepspeed.world_size == defaults.pretrain.deepspeed.world_size
    assert overridden.curation == defaults.curation
    run_config = {"resources": {"platform": {"config": {"evaluate": {"gate_margn": {"seg": 0.1}}}}}}
    result = dg.materialize([probe], resources={"platform": PlatformResource()}, run_config=run_config,
                            raise_on_error=False)
    assert not result.success
    assert "evaluate.gate_margn" in str(next(e for e in result.all_events if e.is_failure).event_specific_data)
