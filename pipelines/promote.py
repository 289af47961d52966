"""Gated promotion of a registered model version to the `champion` alias.

A challenger replaces the champion only when both were evaluated on the same split and the
challenger is strictly better on the chosen metric. Metrics are read from the version tags
written at registration (`eval.<metric>`, `eval.split_id`), so the gate does not depend on run
retention. Every decision is written back to the challenger as `promotion.*` tags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from pipelines.tracking import tracking_uri_for
from pipelines.workspace import Workspace

CHAMPION = "champion"
PREVIOUS = "previous"
SPLIT_TAG = "eval.split_id"


@dataclass(frozen=True)
class PromotionDecision:
    """What the gate decided for one challenger and why."""

    promoted: bool
    reason: str
    challenger_version: str
    challenger_value: float | None
    champion_version: str | None
    champion_value: float | None


def _metric(mv: ModelVersion, metric_name: str) -> float | None:
    raw = mv.tags.get(f"eval.{metric_name}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    version = client.get_registered_model(model_name).aliases.get(CHAMPION)
    return client.get_model_version(model_name, str(version)) if version is not None else None


def _judge(challenger: ModelVersion, champion: ModelVersion | None, metric_name: str,
           higher_is_better: bool, split_id: str) -> tuple[bool, str]:
    value = _metric(challenger, metric_name)
    chal_split = challenger.tags.get(SPLIT_TAG)
    if value is None:
        return False, f"challenger v{challenger.version} has no numeric eval.{metric_name} tag"
    if chal_split != split_id:
        return False, (f"challenger v{challenger.version} was evaluated on split {chal_split!r}, "
                       f"not the promotion split {split_id!r}")
    if champion is None:
        return True, f"no champion yet; challenger v{challenger.version} {metric_name}={value:.6g}"
    if str(champion.version) == str(challenger.version):
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


def promote(model_name: str, version: str | int, metric_name: str, higher_is_better: bool,
            split_id: str, reason_prefix: str = "",
            client: MlflowClient | None = None) -> PromotionDecision:
    """Compare version `version` of `model_name` with the `champion` and promote if better.

    On promotion the old champion (if any) becomes `previous`. The decision is recorded on the
    challenger as tags `promotion.decision` (promoted/refused), `promotion.reason` and
    `promotion.compared_to` (champion version or 'none').
    """
    client = client or MlflowClient()
    challenger = client.get_model_version(model_name, str(version))
    champion = _champion(client, model_name)
    promoted, reason = _judge(challenger, champion, metric_name, higher_is_better, split_id)
    reason = f"{reason_prefix}{reason}"
    if promoted:
        if champion is not None:
            client.set_registered_model_alias(model_name, PREVIOUS, str(champion.version))
        client.set_registered_model_alias(model_name, CHAMPION, str(challenger.version))
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
    args = parser.parse_args(argv)
    uri = args.tracking_uri or tracking_uri_for(Workspace.from_env().root)
    decision = promote(args.model, args.version, args.metric, not args.lower_is_better, args.split_id,
                       args.reason_prefix, client=MlflowClient(tracking_uri=uri, registry_uri=uri))
    print(json.dumps(asdict(decision), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
