"""Promotion gate against a real MLflow registry (SQLite store in a temp folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
from mlflow import MlflowClient

from pipelines.promote import main, promote


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    # One SQLite store per module: creating its schema costs seconds; each test gets its own model.
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


class Registry(NamedTuple):
    client: MlflowClient
    model: str


@pytest.fixture()
def reg(store: MlflowClient, request: pytest.FixtureRequest) -> Registry:
    store.create_registered_model(request.node.name)
    return Registry(store, request.node.name)


def _register(reg: Registry, tmp_path: Path, ap: float | None, split: str = "split-a") -> str:
    source = tmp_path / f"model_{len(list(tmp_path.glob('model_*')))}"
    source.mkdir()
    tags = {"eval.split_id": split, **({"eval.AP": str(ap)} if ap is not None else {})}
    return str(reg.client.create_model_version(reg.model, source=str(source), tags=tags).version)


def _gate(reg: Registry, version: str, split: str = "split-a", higher: bool = True):
    return promote(reg.model, version, "AP", higher, split, reason_prefix="run r1: ", client=reg.client)


def _alias(reg: Registry, alias: str) -> str:
    return str(reg.client.get_model_version_by_alias(reg.model, alias).version)


def _tags(reg: Registry, version: str) -> dict[str, str]:
    return reg.client.get_model_version(reg.model, version).tags


def test_promotion_sequence(reg: Registry, tmp_path: Path) -> None:
    v1 = _register(reg, tmp_path, 0.50)
    first = _gate(reg, v1)
    assert first.promoted and first.champion_version is None and first.challenger_value == 0.5
    assert _alias(reg, "champion") == v1
    assert _tags(reg, v1)["promotion.compared_to"] == "none"
    assert first.reason.startswith("run r1: no champion yet")

    v2 = _register(reg, tmp_path, 0.62)
    better = _gate(reg, v2)
    assert better.promoted and better.champion_version == v1 and better.champion_value == 0.5
    assert (_alias(reg, "champion"), _alias(reg, "previous")) == (v2, v1)
    assert _tags(reg, v2)["promotion.decision"] == "promoted"
    assert _tags(reg, v2)["promotion.compared_to"] == v1

    v3 = _register(reg, tmp_path, 0.40)
    worse = _gate(reg, v3)
    assert not worse.promoted and "worse than" in worse.reason
    assert _alias(reg, "champion") == v2
    tags = _tags(reg, v3)
    assert tags["promotion.decision"] == "refused" and tags["promotion.reason"] == worse.reason
    assert tags["promotion.compared_to"] == v2

    v4 = _register(reg, tmp_path, 0.62)
    equal = _gate(reg, v4)
    assert not equal.promoted and "equal to" in equal.reason
    assert (_alias(reg, "champion"), _alias(reg, "previous")) == (v2, v1)


def test_split_mismatch_is_refused(reg: Registry, tmp_path: Path) -> None:
    v1 = _register(reg, tmp_path, 0.50)
    assert _gate(reg, v1).promoted
    v2 = _register(reg, tmp_path, 0.90, split="split-b")
    other_split = _gate(reg, v2, split="split-b")
    assert not other_split.promoted
    assert "split-a" in other_split.reason and "not comparable" in other_split.reason
    mislabelled = _gate(reg, v2, split="split-a")
    assert not mislabelled.promoted and "evaluated on split 'split-b'" in mislabelled.reason
    assert _alias(reg, "champion") == v1


def test_lower_is_better_and_missing_metric(reg: Registry, tmp_path: Path) -> None:
    v1 = _register(reg, tmp_path, 12.0)
    assert _gate(reg, v1, higher=False).promoted
    v2 = _register(reg, tmp_path, 9.5)
    assert _gate(reg, v2, higher=False).promoted
    v3 = _register(reg, tmp_path, None)
    missing = _gate(reg, v3, higher=False)
    assert not missing.promoted and "no numeric eval.AP" in missing.reason
    assert _alias(reg, "champion") == v2
    assert not _gate(reg, v2, higher=False).promoted  # already champion


def test_cli_prints_decision(reg: Registry, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    v1 = _register(reg, tmp_path, 0.3)
    uri = reg.client.tracking_uri
    argv = ["--model", reg.model, "--version", v1, "--metric", "AP", "--split-id", "split-a",
            "--tracking-uri", uri]
    assert main(argv) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["promoted"] and decision["challenger_version"] == v1
    assert _alias(reg, "champion") == v1
