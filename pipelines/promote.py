"""Gated promotion of a model version to the `champion` alias, in place or into production.

A challenger replaces the champion only when its recorded evaluation passed the gate (tag
`eval.gate.passed`, written at registration; versions without it predate the gate), both were
evaluated on the same split and the challenger is strictly better on the chosen metric. Metrics are read from the version tags
written at registration (`eval.<metric>`, `eval.split_id`), so the gate does not depend on run
retention. Every decision is written back to the challenger as `promotion.*` tags.

With a `Production` target the gated development version is copied into the production
registered model (`<name>-production`, or the same name in a separate registry given by
`$SAPIENS2_PRODUCTION_REGISTRY_URI`) and `champion` moves there; the replaced champion stays
reachable as `previous`. The copy records who, when, why, from which version and evaluation
run. Judging and moving the aliases happen under the target model's registry lock, so two
racing promotions are serialised: each judges against the champion the other left. A promotion
killed between its copy and the alias move leaves a production version that is not champion; the
rerun finds it (`_existing_copy`) and moves the alias to it instead of copying again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from pipelines.common.model_registry import (CHAMPION, DEMOTED_TAG, GATE_PASSED_TAG, GATE_REASON_TAG, MODEL_SHA_TAG,
                                             PREVIOUS, PRODUCTION_SUFFIX, SPLIT_TAG, Production, Request)
from pipelines.common.registry_lock import registry_lock
from pipelines.common.tracking import tracking_uri_for
from pipelines.common.workspace import Workspace

@dataclass(frozen=True)
class PromotionDecision:
    """What the gate decided for one challenger and why."""

    promoted: bool
    reason: str
    challenger_version: str
    challenger_value: float | None
    champion_version: str | None
    champion_value: float | None
    production_version: str | None = None


def _metric(mv: ModelVersion, metric_name: str) -> float | None:
    raw = mv.tags.get(f"eval.{metric_name}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    found = client.search_registered_models(filter_string=f"name = '{model_name}'")
    version = found[0].aliases.get(CHAMPION) if found else None
    return client.get_model_version(model_name, str(version)) if version is not None else None


def source_uri(mv: ModelVersion) -> str:
    return f"models:/{mv.name}/{mv.version}"


def _judge(challenger: ModelVersion, champion: ModelVersion | None, metric_name: str,
           higher_is_better: bool, split_id: str) -> tuple[bool, str]:
    value = _metric(challenger, metric_name)
    chal_split = challenger.tags.get(SPLIT_TAG)
    if challenger.tags.get(DEMOTED_TAG):
        return False, f"challenger v{challenger.version} was rolled back from production: {challenger.tags[DEMOTED_TAG]}"
    if challenger.tags.get(GATE_PASSED_TAG) == "false":
        return False, (f"challenger v{challenger.version} failed the evaluation gate: "
                       f"{challenger.tags.get(GATE_REASON_TAG, 'no reason recorded')}")
    if value is None:
        return False, f"challenger v{challenger.version} has no numeric eval.{metric_name} tag"
    if chal_split != split_id:
        return False, (f"challenger v{challenger.version} was evaluated on split {chal_split!r}, "
                       f"not the promotion split {split_id!r}")
    if champion is None:
        return True, f"no champion yet; challenger v{challenger.version} {metric_name}={value:.6g}"
    if str(champion.version) == str(challenger.version) and champion.name == challenger.name \
            or champion.tags.get("promotion.source") == source_uri(challenger):
        return False, f"v{challenger.version} is already the champion"
    champ_value, champ_split = _metric(champion, metric_name), champion.tags.get(SPLIT_TAG)
    if champ_split != split_id:
        return False, (f"champion v{champion.version} was evaluated on split {champ_split!r}, "
                       f"challenger on {split_id!r}: not comparable")
    if champ_value is None:
        return False, f"champion v{champion.version} has no numeric eval.{metric_name} tag"
    better = value > champ_value if higher_is_better else value < champ_value
    relation = ("better than" if better else
                "equal to" if value == champ_value else "worse than")
    return better, (f"challenger v{challenger.version} {metric_name}={value:.6g} is {relation} "
                    f"champion v{champion.version} {champ_value:.6g} on split {split_id!r}"
                    f" ({'higher' if higher_is_better else 'lower'} is better)")


def _existing_copy(challenger: ModelVersion, production: Production) -> ModelVersion | None:
    """A production version already made from `challenger` and never rolled back: a copy whose
    source is the challenger (same registry), that names it as `promotion.source`, or that carries
    its weights' hash on the same split (a copy keeps the challenger's tags)."""
    weights = challenger.tags.get(MODEL_SHA_TAG)
    for mv in production.client.search_model_versions(f"name = '{production.name}'"):
        same_weights = weights is not None and mv.tags.get(MODEL_SHA_TAG) == weights \
            and mv.tags.get(SPLIT_TAG) == challenger.tags.get(SPLIT_TAG)
        made_from = mv.source == source_uri(challenger) or mv.tags.get("promotion.source") == source_uri(challenger)
        if (made_from or same_weights) and not mv.tags.get(DEMOTED_TAG):
            return mv
    return None


def _copy(challenger: ModelVersion, client: MlflowClient, production: Production) -> ModelVersion:
    """The challenger as a new version of the production model (same artifacts, same tags)."""
    if production.client is client or production.client.tracking_uri == client.tracking_uri:
        return client.copy_model_version(source_uri(challenger), production.name)
    try:
        production.client.create_registered_model(production.name)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    source = client.get_model_version_download_uri(challenger.name, challenger.version)
    return production.client.create_model_version(production.name, source, tags=challenger.tags,
                                                  description=challenger.description)


def promote(model_name: str, version: str | int, metric_name: str, higher_is_better: bool,
            split_id: str, reason_prefix: str = "", client: MlflowClient | None = None, *,
            production: Production | None = None, request: Request | None = None) -> PromotionDecision:
    """Compare version `version` of `model_name` with the `champion` and promote if better.

    The champion is read from `production` when given (the challenger is copied there on
    promotion), else from `model_name` itself. On promotion the old champion (if any) becomes
    `previous`. The decision is recorded on the challenger as tags `promotion.decision`
    (promoted/refused), `promotion.reason` and `promotion.compared_to` (champion version or
    'none'); a production copy also gets `request`'s who/when/why tags, `promotion.source` and
    `promotion.replaced`.
    """
    client = client or MlflowClient()
    target_client, target = (production.client, production.name) if production else (client, model_name)
    request = request or Request(reason=reason_prefix.strip() or "unspecified")
    with registry_lock(target_client, target, holder=f"{request.requested_by} {request.dagster_run_id}".strip()):
        challenger = client.get_model_version(model_name, str(version))
        champion = _champion(target_client, target)
        promoted, reason = _judge(challenger, champion, metric_name, higher_is_better, split_id)
        reason = f"{reason_prefix}{reason}"
        new_champion = challenger
        if promoted:
            if production is not None:
                new_champion = _existing_copy(challenger, production) or _copy(challenger, client, production)
                copy_tags = {**request.tags("promotion"), "promotion.source": source_uri(challenger),
                             "promotion.replaced": str(champion.version) if champion is not None else "none",
                             "promotion.gate": reason}
                for key, value in copy_tags.items():
                    target_client.set_model_version_tag(target, str(new_champion.version), key, value)
            if champion is not None:
                target_client.set_registered_model_alias(target, PREVIOUS, str(champion.version))
            target_client.set_registered_model_alias(target, CHAMPION, str(new_champion.version))
        tags = {
            "promotion.decision": "promoted" if promoted else "refused",
            "promotion.reason": reason,
            "promotion.compared_to": str(champion.version) if champion is not None else "none",
        }
        for key, value in tags.items():
            client.set_model_version_tag(model_name, str(challenger.version), key, value)
    return PromotionDecision(
        promoted=promoted,
        reason=reason,
        challenger_version=str(challenger.version),
        challenger_value=_metric(challenger, metric_name),
        champion_version=str(champion.version) if champion is not None else None,
        champion_value=_metric(champion, metric_name) if champion is not None else None,
        production_version=str(new_champion.version) if promoted and production is not None else None,
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: `sapiens2 promote --model M --version V --metric AP --split-id S`; prints the decision
    as JSON. Exit status 0 whether promoted or refused (a refusal is a normal outcome)."""
    parser = argparse.ArgumentParser(description="promote a model version to the champion alias")
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--metric", required=True, help="metric name, read from tag eval.<metric>")
    parser.add_argument("--split-id", required=True)
    parser.add_argument("--lower-is-better", action="store_true")
    parser.add_argument("--reason-prefix", default="")
    parser.add_argument("--tracking-uri", default=None, help="default: the workspace's store")
    parser.add_argument("--production", action="store_true",
                        help=f"copy into <model>{PRODUCTION_SUFFIX} (or $SAPIENS2_PRODUCTION_REGISTRY_URI) and move champion there")
    parser.add_argument("--reason", default="", help="why (recorded on the production version)")
    parser.add_argument("--evaluation-run", default="", help="MLflow run id of the evaluation behind the decision")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or tracking_uri_for(Workspace.from_env().root)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    production = Production.for_model(args.model, client) if args.production else None
    request = Request(reason=args.reason or args.reason_prefix.strip() or "manual promotion", evaluation_run=args.evaluation_run)
    decision = promote(args.model, args.version, args.metric, not args.lower_is_better, args.split_id,
                       args.reason_prefix, client=client, production=production, request=request)
    print(json.dumps(asdict(decision), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
