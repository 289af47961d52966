"""The Dagster code location: every asset, check, job and resource of the platform."""


import os

import dagster as dg

from assets.curation import (curated_dataset, curated_expectations, filter_shards_job, new_shards, pool_shards,
                             raw_pool, shard_scores, versioned_dataset)
from assets.registry import (champion_models, evaluation_report, every_task_beats_baseline, registered_models,
                             rollback_job)
from assets.resources import WORKSPACE_WRITER, DvcResource, PlatformResource
from assets.training import TRAINING_TAGS, finetuned_models, pretrained_backbone, scratch_models
from pipelines.common.launch import training_slots

# The end-to-end graph; `shard_scores` (partitioned per pool shard) runs on its own, from the
# new_shards sensor or a backfill, and curated_dataset filters whatever shards it left.
ALL_ASSETS = [raw_pool, pool_shards, curated_dataset, versioned_dataset, pretrained_backbone, *finetuned_models, *scratch_models,
              evaluation_report, registered_models, champion_models]
ALL_CHECKS = [curated_expectations, every_task_beats_baseline]

K8S_WORKSPACE_CLAIM = "sapiens2-workspace"  # infra/k8s/storage.yaml: shared by every run and step pod
# infra/k8s/network-policy.yaml admits only pods with this label to MLflow.
K8S_MLFLOW_CLIENT_LABEL = {"sapiens2/mlflow-client": "true"}
# What every container of the platform runs with (infra/k8s manifests, Helm values, step pods):
# not root, no privilege escalation, no capabilities, a read-only root filesystem.
K8S_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                          "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True, "runAsUser": 10001}


def k8s_step_pods(tag_limits: list[dict]) -> dict:
    """dagster-k8s executor settings of the step pods (the same volumes, labels and security as
    the run pods of infra/k8s/dagster-values.yaml)."""
    return {
        "env_config_maps": ["sapiens2-services"], "env_secrets": ["sapiens2-s3"],
        "volume_mounts": [{"name": "workspace", "mount_path": "/workspace"}, {"name": "tmp", "mount_path": "/tmp"}],
        "volumes": [{"name": "workspace", "persistent_volume_claim": {"claim_name": K8S_WORKSPACE_CLAIM}},
                    {"name": "tmp", "empty_dir": {}}],
        "env_vars": ["HOME=/tmp"],  # caches of torch, DeepSpeed, DVC: the root filesystem is read-only
        "labels": K8S_MLFLOW_CLIENT_LABEL,
        "security_context": K8S_CONTAINER_SECURITY,
        "tag_concurrency_limits": tag_limits,
    }


def build_executor(kind: str | None = None) -> dg.ExecutorDefinition:
    """``SAPIENS2_EXECUTOR``: ``multiprocess`` (default; every step a process on this machine) or
    ``k8s`` (every step a Kubernetes Job in the run's namespace, dagster-k8s). The assets are the
    same either way; at scale each pool shard and each fine-tuning task gets its own pod."""
    kind = kind or os.environ.get("SAPIENS2_EXECUTOR", "multiprocess")
    limits = [{"key": key, "value": value, "limit": training_slots()} for key, value in TRAINING_TAGS.items()]
    if kind == "multiprocess":
        # Step processes fork from a server that imported the code location once (~7 s a step otherwise).
        start = {"forkserver": {"preload_modules": ["assets.definitions"]}}
        return dg.multiprocess_executor.configured({"tag_concurrency_limits": limits, "start_method": start})
    if kind == "k8s":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor.configured(k8s_step_pods(limits))
    raise ValueError(f"SAPIENS2_EXECUTOR={kind!r}: expected 'multiprocess' or 'k8s'")


executor = build_executor()

end_to_end = dg.define_asset_job(
    "end_to_end", selection=dg.AssetSelection.assets(*ALL_ASSETS), executor_def=executor, tags=WORKSPACE_WRITER,
    description="Synthetic pool to champion model: curate, validate, version, pretrain, fine-tune x5, evaluate, register, promote.",
)
promote_job = dg.define_asset_job(
    "promote", selection=dg.AssetSelection.assets(champion_models), tags=WORKSPACE_WRITER,
    description="Copy each task's newest version into its production model as champion if it beats the champion there.",
)

defs = dg.Definitions(
    assets=[*ALL_ASSETS, shard_scores],
    asset_checks=ALL_CHECKS,
    jobs=[end_to_end, promote_job, rollback_job, filter_shards_job],
    sensors=[new_shards],
    executor=executor,
    resources={
        "platform": PlatformResource(),
        "dvc": DvcResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    },
)
