"""Production registry against real MLflow SQLite stores: gated copies into `<name>-production`,
who/when/why tags, rollback walking the history, a separate registry URI, and two racing
promotions serialised by the registry lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipelines import promote as promote_mod
from pipelines.common.model_registry import DEMOTED_TAG, Production, Request
from pipelines.promote import promote
from pipelines.common.registry_lock import RegistryLockTimeout, registry_lock
from pipelines.rollback import RollbackError, rollback


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@pytest.fixture()
def model(store: MlflowClient, request: pytest.FixtureRequest) -> str:
    store.create_registered_model(request.node.name)
    return request.node.name


def _register(client: MlflowClient, name: str, tmp_path: Path, ap: float) -> str:
    source = tmp_path / f"model_{time.monotonic_ns()}"
    source.mkdir()
    return str(client.create_model_version(name, str(source), tags={"eval.split_id": "s", "eval.AP": str(ap)}).version)


def _promote(client: MlflowClient, name: str, version: str, production: Production, reason: str = "weekly release"):
    request = Request(reason=reason, requested_by="alice", evaluation_run="evalrun123", dagster_run_id="dag-1")
    return promote(name, version, "AP", True, "s", client=client, production=production, request=request)


def _aliases(production: Production) -> dict[str, str]:
    return {k: str(v) for k, v in production.client.get_registered_model(production.name).aliases.items()}


def test_promotion_copies_into_production_and_rollback_restores(store: MlflowClient, model: str, tmp_path: Path) -> None:
    prod = Production.for_model(model, store)
    assert prod.name == f"{model}-production"
    v1, v2 = _register(store, model, tmp_path, 0.5), _register(store, model, tmp_path, 0.7)
    first = _promote(store, model, v1, prod)
    assert first.promoted and first.production_version == "1"
    second = _promote(store, model, v2, prod)
    assert second.promoted and second.champion_version == "1" and second.production_version == "2"
    assert _aliases(prod) == {"champion": "2", "previous": "1"}
    assert store.get_registered_model(model).aliases == {}  # development model keeps no champion
    copy = store.get_model_version(prod.name, "2")
    assert copy.source == f"models:/{model}/{v2}" and copy.tags["eval.AP"] == "0.7"
    assert {k: copy.tags[k] for k in ("promotion.by", "promotion.reason", "promotion.evaluation_run",
                                      "promotion.dagster_run_id", "promotion.replaced")} == {
        "promotion.by": "alice", "promotion.reason": "weekly release", "promotion.evaluation_run": "evalrun123",
        "promotion.dagster_run_id": "dag-1", "promotion.replaced": "1"}
    assert copy.tags["promotion.at"].endswith("Z")
    again = _promote(store, model, v2, prod)
    assert not again.promoted and "already the champion" in again.reason

    back = rollback(prod, Request(reason="AP regression in canary", requested_by="bob"), dev_client=store)
    assert (back.restored_version, back.demoted_version, back.previous_version) == ("1", "2", None)
    assert _aliases(prod) == {"champion": "1"}
    restored = store.get_model_version(prod.name, "1").tags
    assert restored["rollback.reason"] == "AP regression in canary" and restored["rollback.by"] == "bob"
    assert restored["rollback.from_version"] == "2"
    assert "AP regression" in store.get_model_version(prod.name, "2").tags[DEMOTED_TAG]
    # The demoted development version is not promoted again by the next gate run.
    retry = _promote(store, model, v2, prod)
    assert not retry.promoted and "rolled back" in retry.reason
    with pytest.raises(RollbackError, match="no 'previous'"):
        rollback(prod, Request(reason="again"), dev_client=store)


def test_rollback_walks_back_through_history(store: MlflowClient, model: str, tmp_path: Path) -> None:
    prod = Production.for_model(model, store)
    for ap in (0.1, 0.2, 0.3):
        assert _promote(store, model, _register(store, model, tmp_path, ap), prod).promoted
    assert _aliases(prod) == {"champion": "3", "previous": "2"}
    assert rollback(prod, Request(reason="r1")).previous_version == "1"
    assert _aliases(prod) == {"champion": "2", "previous": "1"}
    rollback(prod, Request(reason="r2"))
    assert _aliases(prod) == {"champion": "1"}


def test_separate_production_registry_uri(store: MlflowClient, model: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    prod_uri = f"sqlite:///{tmp_path / 'production.db'}"
    monkeypatch.setenv("SAPIENS2_PRODUCTION_REGISTRY_URI", prod_uri)
    prod = Production.for_model(model, store)
    assert prod.name == model and prod.client.tracking_uri == prod_uri
    v1 = _register(store, model, tmp_path, 0.4)
    decision = _promote(store, model, v1, prod)
    assert decision.promoted
    copy = prod.client.get_model_version_by_alias(model, "champion")
    assert Path(copy.source.removeprefix("file://")).is_dir() and copy.tags["promotion.source"] == f"models:/{model}/{v1}"
    assert store.get_registered_model(model).aliases == {}


def test_two_racing_promotions_leave_one_consistent_champion(store: MlflowClient, model: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    prod = Production.for_model(model, store)
    assert _promote(store, model, _register(store, model, tmp_path, 0.5), prod).promoted
    a, b = _register(store, model, tmp_path, 0.7), _register(store, model, tmp_path, 0.8)
    # Widen the window between reading the champion and moving the alias: without the lock
    # both challengers would judge against v1 and both would replace it.
    real_judge = promote_mod._judge
    monkeypatch.setattr(promote_mod, "_judge", lambda *args: (time.sleep(0.5), real_judge(*args))[1])
    start, decisions = threading.Barrier(2), {}

    def run(version: str) -> None:
        client = MlflowClient(tracking_uri=store.tracking_uri, registry_uri=store.tracking_uri)
        start.wait()
        decisions[version] = _promote(client, model, version, Production(prod.name, client))

    threads = [threading.Thread(target=run, args=(v,)) for v in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    aliases = _aliases(prod)
    champion = store.get_model_version(prod.name, aliases["champion"])
    assert champion.tags["promotion.source"] == f"models:/{model}/{b}"  # the better one wins either order
    assert aliases["previous"] == champion.tags["promotion.replaced"]
    copies = [mv for mv in store.search_model_versions(f"name = '{prod.name}'") if "promotion.replaced" in mv.tags]
    replaced = [mv.tags["promotion.replaced"] for mv in copies]
    assert len(replaced) == len(set(replaced)), f"two promotions replaced the same champion: {replaced}"
    assert sum(d.promoted for d in decisions.values()) == len(copies) - 1  # minus the first, unraced one
    assert not any(m.name.endswith(".lock") for m in store.search_registered_models())


def test_lock_times_out_and_breaks_stale_holders(store: MlflowClient, model: str) -> None:
    with registry_lock(store, model, holder="first"):
        with pytest.raises(RegistryLockTimeout, match="locked by 'first'"):
            with registry_lock(store, model, holder="second", timeout_s=0.5):
                pass
    store.create_registered_model(f"{model}.lock", tags={"holder": "dead", "since": "0"})
    with registry_lock(store, model, holder="third", stale_s=60):
        assert store.get_registered_model(f"{model}.lock").tags["holder"] == "third"


def test_a_holder_whose_lock_was_broken_does_not_release_the_new_holders(store: MlflowClient, model: str) -> None:
    lock = f"{model}.lock"
    with registry_lock(store, model, holder="slow", stale_s=0.0):
        # "slow" looked dead (stale_s 0): "fast" breaks the lock and takes it meanwhile.
        store.delete_registered_model(lock)
        store.create_registered_model(lock, tags={"holder": "fast", "since": "9e18", "token": "fast-token"})
    assert store.get_registered_model(lock).tags["holder"] == "fast", "slow's release deleted fast's lock"
    store.delete_registered_model(lock)


def test_a_rollback_killed_before_its_alias_moves_is_repeated_by_the_next(
        store: MlflowClient, model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demoted version is tagged first; a kill before the alias move leaves the aliases as
    they were and the rerun finishes the same rollback."""
    prod = Production.for_model(model, store)
    for ap in (0.5, 0.7):
        _promote(store, model, _register(store, model, tmp_path, ap), prod)
    assert _aliases(prod) == {"champion": "2", "previous": "1"}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the alias moved")

    with monkeypatch.context() as patch:
        patch.setattr(store, "set_registered_model_alias", killed)
        with pytest.raises(KeyboardInterrupt):
            rollback(prod, Request(reason="bad champion", requested_by="bob"), dev_client=store)
    assert _aliases(prod) == {"champion": "2", "previous": "1"}
    assert "bad champion" in store.get_model_version(prod.name, "2").tags[DEMOTED_TAG]
    done = rollback(prod, Request(reason="bad champion", requested_by="bob"), dev_client=store)
    assert (done.restored_version, done.demoted_version) == ("1", "2") and _aliases(prod) == {"champion": "1"}


def test_a_promotion_killed_after_its_copy_is_finished_by_the_rerun(store: MlflowClient, model: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between the production copy and the alias move: the rerun moves the alias to that
    copy instead of adding a second one (no orphan, one champion)."""
    prod = Production.for_model(model, store)
    v1, v2 = _register(store, model, tmp_path, 0.5), _register(store, model, tmp_path, 0.7)
    assert _promote(store, model, v1, prod).promoted

    def killed(*_args, **_kwargs):
        raise KeyboardInterrupt("killed before the alias moved")

    with monkeypatch.context() as patch:
        patch.setattr(store, "set_registered_model_alias", killed)
        with pytest.raises(KeyboardInterrupt):
            _promote(store, model, v2, prod)
    assert _aliases(prod) == {"champion": "1"}
    assert len(store.search_model_versions(f"name = '{prod.name}'")) == 2  # the orphan copy

    rerun = _promote(store, model, v2, prod)
    assert rerun.promoted and rerun.production_version == "2"
    assert _aliases(prod) == {"champion": "2", "previous": "1"}
    assert len(store.search_model_versions(f"name = '{prod.name}'")) == 2
