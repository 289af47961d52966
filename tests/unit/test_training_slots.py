"""Training slots: how many training programs a node runs at once and the threads each rank gets."""

from __future__ import annotations

import pytest
import yaml

from pipelines.common import launch
from pipelines.common.workspace import PROJECT_ROOT


def test_the_instance_pool_admits_as_many_training_steps_as_the_launcher_plans_for() -> None:
    instance = yaml.safe_load((PROJECT_ROOT / "dagster.yaml").read_text())
    assert instance["concurrency"]["pools"]["default_limit"] == launch.DEFAULT_TRAINING_SLOTS


@pytest.mark.parametrize(("cores", "ranks", "slots", "threads"), [(2, 1, 2, 1), (2, 2, 2, 1), (16, 1, 2, 8),
                                                                  (16, 2, 2, 4), (2, 1, 1, 2), (1, 4, 2, 1)])
def test_each_rank_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int,
                                               slots: int, threads: int) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SAPIENS2_TRAINING_SLOTS", str(slots))
    monkeypatch.setattr(launch.os, "cpu_count", lambda: cores)
    assert launch.threads_per_rank(ranks) == threads


def test_a_chosen_thread_count_wins_and_a_bad_slot_count_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.threads_per_rank(2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("SAPIENS2_TRAINING_SLOTS", "0")
    with pytest.raises(ValueError, match="SAPIENS2_TRAINING_SLOTS='0'"):
        launch.threads_per_rank(1)
