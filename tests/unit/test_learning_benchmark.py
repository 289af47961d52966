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
