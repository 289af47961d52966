"""The model registry's vocabulary, shared by registration, promotion and rollback: the aliases,
the tags their decisions write, where production versions live and who asked for a change."""

from __future__ import annotations

import getpass
import os
import time
from dataclasses import dataclass, field

from mlflow import MlflowClient

CHAMPION = "champion"
PREVIOUS = "previous"
SPLIT_TAG = "eval.split_id"
MODEL_SHA_TAG = "model.sha256"  # the weights a version holds (`pipelines.common.lineage.model_sha256`)
PRODUCTION_SUFFIX = "-production"
DEMOTED_TAG = "rollback.demoted"
GATE_PASSED_TAG = "eval.gate.passed"
GATE_REASON_TAG = "eval.gate.reason"


@dataclass(frozen=True)
class Production:
    """Where gated versions go: a registered model, in the development or a separate registry."""

    name: str
    client: MlflowClient

    @classmethod
    def for_model(cls, dev_name: str, dev_client: MlflowClient) -> Production:
        uri = os.environ.get("SAPIENS2_PRODUCTION_REGISTRY_URI")
        if uri:
            return cls(dev_name, MlflowClient(tracking_uri=uri, registry_uri=uri))
        return cls(f"{dev_name}{PRODUCTION_SUFFIX}", dev_client)


@dataclass(frozen=True)
class Request:
    """Who asked for a promotion or rollback, why, and from which evaluation and Dagster run."""

    reason: str
    requested_by: str = field(default_factory=getpass.getuser)
    evaluation_run: str = ""
    dagster_run_id: str = ""

    def tags(self, prefix: str) -> dict[str, str]:
        return {f"{prefix}.by": self.requested_by, f"{prefix}.at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                f"{prefix}.reason": self.reason, f"{prefix}.evaluation_run": self.evaluation_run or "none",
                f"{prefix}.dagster_run_id": self.dagster_run_id or "none"}
