"""benchmarks/learning.py's recipe: the params.yaml it writes loads as a valid platform config and
carries the benchmark's choices (the pretraining objective, normal's backbone freeze beside pose's
own, the budget), so a config change that breaks or silently drops one fails here, not 45 minutes
into a run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipelines.common.config import load_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location("learning_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_written_params_load_and_carry_the_benchmark_recipe(learning, tmp_path: Path) -> None:
    args = learning._parser().parse_args(["--pretrain-steps", "2800"])
    config = load_config(learning._params(tmp_path, args))

    objective = config.pretrain.objective
    assert (objective.position_weight, objective.mae_weight, objective.mae_view) == (1.0, 1.0, "position")
    assert objective.cl_weight == objective.ibot_weight == 0.0
    assert config.pretrain.steps == 2800 and config.synth.n_people == 1600
    # Normal holds its backbone for half its run; pose keeps params.yaml's own LP-FT share.
    assert config.finetune.optim_for("normal").backbone_frozen_fraction == 0.5
    assert config.finetune.optim_for("normal").backbone_frozen_steps(config.finetune.steps_for("normal")) == 200
    assert config.finetune.optim_for("pose").backbone_frozen_fraction == 0.2
    assert config.finetune.optim_for("albedo").backbone_frozen_fraction == 0.0


def test_normal_frozen_fraction_is_a_flag_and_the_config_refuses_a_full_freeze(learning, tmp_path: Path) -> None:
    args = learning._parser().parse_args(["--pretrain-steps", "2800", "--normal-frozen-fraction", "0"])
    config = load_config(learning._params(tmp_path, args))
    assert config.finetune.optim_for("normal").backbone_frozen_fraction == 0.0

    args = learning._parser().parse_args(["--pretrain-steps", "2800", "--normal-frozen-fraction", "1"])
    with pytest.raises(ValueError, match="task_optim.normal.*backbone_frozen_fraction"):
        load_config(learning._params(tmp_path, args))


def _report(task: str, metric: str, higher: bool, pretrained: float, scratch: float) -> dict:
    return {"task": task, "primary_metric": metric, "higher_is_better": higher,
            "metrics": {metric: pretrained}, "scratch": {metric: scratch}}


def test_pretrained_vs_scratch_counts_by_the_mean_over_seeds_and_the_metric_direction(learning) -> None:
    # Two seeds: pose wins one draw by a little and loses one by more (the mean says scratch); the
    # error metrics count lower as better.
    draws = {
        0: {"pose": (0.42, 0.40), "seg": (0.20, 0.19), "normal": (20.0, 21.0), "pointmap": (0.15, 0.13),
            "albedo": (18.0, 18.0)},
        1: {"pose": (0.38, 0.41), "seg": (0.21, 0.20), "normal": (20.5, 20.4), "pointmap": (0.15, 0.16),
            "albedo": (18.0, 18.0)},
    }
    metric = {"pose": ("AP", True), "seg": ("mIoU", True), "normal": ("angular_error_mean", False),
              "pointmap": ("canonical_l2_mean", False), "albedo": ("psnr", True)}
    results = {f"labels_{learning._tag(0.1, seed)}": [_report(t, *metric[t], *draws[seed][t]) for t in draws[seed]]
               for seed in draws}
    assert set(results) == {"labels_0.1", "labels_0.1_seed1"}  # seed 0 keeps the earlier runs' layout

    summary = learning._pretrained_vs_scratch(results, [0.1], [0, 1])["0.1"]
    tasks = summary["tasks"]
    assert tasks["pose"]["pretrained"] == [0.42, 0.38] and tasks["pose"]["seeds_pretrained_better"] == 1
    assert not tasks["pose"]["pretrained_better_by_mean"]  # 0.40 against 0.405
    assert tasks["seg"]["pretrained_better_by_mean"] and tasks["seg"]["seeds_pretrained_better"] == 2
    assert tasks["normal"]["pretrained_better_by_mean"]  # 20.25 deg against 20.7: lower wins
    assert tasks["pointmap"]["seeds_pretrained_better"] == 1 and not tasks["pointmap"]["pretrained_better_by_mean"]
    assert not tasks["albedo"]["pretrained_better_by_mean"]  # a tie is not a win
    assert summary["tasks_pretrained_better_by_mean"] == 2


def test_seeds_are_a_flag_and_a_repeated_seed_is_refused(learning, monkeypatch, tmp_path: Path) -> None:
    assert learning._parser().parse_args([]).seeds == [0]
    assert learning._parser().parse_args(["--seeds", "0", "1", "2"]).seeds == [0, 1, 2]
    work = tmp_path / "work"
    monkeypatch.setattr("sys.argv", ["learning.py", "--work", str(work), "--seeds", "1", "1"])
    with pytest.raises(SystemExit):
        learning.main()
    assert not work.exists()  # refused before any work starts


def test_a_run_reuses_an_earlier_runs_pretraining_only_with_its_upstream_settings(learning, tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "models" / "pretrain").mkdir(parents=True)
    (source / "data" / "curated").mkdir(parents=True)
    args = learning._parser().parse_args(["--pretrain-steps", "2800"])
    learning._params(source, args)
    work = tmp_path / "work"
    work.mkdir()
    params = learning._params(work, learning._parser().parse_args(["--pretrain-steps", "2800", "--pose-steps", "9"]))

    with pytest.raises(SystemExit, match="no finished pretraining"):
        learning._reuse_pretraining(source, work, params)
    (source / "models" / "pretrain" / "backbone.safetensors").write_bytes(b"weights")
    # Fine-tuning settings may differ (pose steps above); the pretraining's may not.
    longer = learning._params(tmp_path, learning._parser().parse_args(["--pretrain-steps", "5600"]))
    with pytest.raises(SystemExit, match=r"params.yaml differs from this run's settings in pretrain;"):
        learning._reuse_pretraining(source, work, longer)
    assert not (work / "models").exists() and not (work / "data").exists()

    learning._reuse_pretraining(source, work, params)
    assert (work / "models" / "pretrain" / "backbone.safetensors").read_bytes() == b"weights"
    assert (work / "data" / "curated").is_dir()
