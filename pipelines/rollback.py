"""Rollback of a production model: `previous` becomes `champion` again.

The demoted version is tagged (and so is the development version it was copied from, which
keeps the promotion gate from promoting it again). `previous` then moves one step further back,
to the version the restored champion had itself replaced, so repeated rollbacks walk the
promotion history instead of toggling between two versions.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from mlflow import MlflowClient

from pipelines.common.model_registry import CHAMPION, DEMOTED_TAG, PREVIOUS, Production, Request
from pipelines.common.registry_lock import registry_lock
from pipelines.common.tracking import tracking_uri_for
from pipelines.common.workspace import Workspace


class RollbackError(RuntimeError):
    """Nothing to roll back to."""


@dataclass(frozen=True)
class Rollback:
    model: str
    restored_version: str
    demoted_version: str
    previous_version: str | None


def rollback(production: Production, request: Request, dev_client: MlflowClient | None = None) -> Rollback:
    """Make `previous` the champion of `production.name`, recording `request` on both versions."""
    client, name = production.client, production.name
    with registry_lock(client, name, holder=f"{request.requested_by} {request.dagster_run_id}".strip()):
        aliases = client.get_registered_model(name).aliases
        if PREVIOUS not in aliases or CHAMPION not in aliases:
            raise RollbackError(f"{name} has no {PREVIOUS!r} version to roll back to (aliases: {aliases})")
        restored, demoted = str(aliases[PREVIOUS]), str(aliases[CHAMPION])
        # The demotion is recorded before any alias moves: a run killed in between leaves the
        # aliases as they were, so a rerun repeats the same rollback, and the demoted version
        # can never be promoted again by the next promotion run.
        note = f"v{demoted} demoted at {request.tags('rollback')['rollback.at']}: {request.reason}"
        client.set_model_version_tag(name, demoted, DEMOTED_TAG, note)
        source = client.get_model_version(name, demoted).tags.get("promotion.source", "")
        if source.startswith("models:/") and dev_client is not None:
            dev_name, dev_version = source.removeprefix("models:/").rsplit("/", 1)
            dev_client.set_model_version_tag(dev_name, dev_version, DEMOTED_TAG, note)
        client.set_registered_model_alias(name, CHAMPION, restored)
        before = client.get_model_version(name, restored).tags.get("promotion.replaced", "none")
        if before != "none":
            client.set_registered_model_alias(name, PREVIOUS, before)
        else:
            client.delete_registered_model_alias(name, PREVIOUS)
        for key, value in {**request.tags("rollback"), "rollback.from_version": demoted}.items():
            client.set_model_version_tag(name, restored, key, value)
    return Rollback(name, restored, demoted, before if before != "none" else None)


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m pipelines.rollback --model sapiens2-pose --reason "..."`; prints the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the development model name (production is derived)")
    parser.add_argument("--reason", required=True)
    parser.add_argument("--tracking-uri", default=None, help="default: the workspace's store")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or tracking_uri_for(Workspace.from_env().root)
    dev = MlflowClient(tracking_uri=uri, registry_uri=uri)
    result = rollback(Production.for_model(args.model, dev), Request(reason=args.reason), dev_client=dev)
    print(json.dumps(asdict(result), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
