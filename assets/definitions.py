"""The Dagster code location: every asset, check, job and resource of the platform."""


import dagster as dg

from assets.curation import (curated_dataset, curated_expectations, filter_shards_job, new_shards, pool_shards,
                             raw_pool, shard_scores, versioned_dataset)
from assets.registry import (champion_models, evaluation_report, every_task_beats_baseline, registered_models,
                             rollback_job)
from assets.resources import DvcResource, PlatformResource
from assets.training import TRAINING_TAGS, finetuned_models, pretrained_backbone

# The end-to-end graph; `shard_scores` (partitioned per pool shard) runs on its own, from the
# new_shards sensor or a backfill, and curated_dataset filters whatever shards it left.
ALL_ASSETS = [raw_pool, pool_shards, curated_dataset, versioned_dataset, pretrained_backbone, *finetuned_models,
              evaluation_report, registered_models, champion_models]
ALL_CHECKS = [curated_expectations, every_task_beats_baseline]

executor = dg.multiprocess_executor.configured({
    "tag_concurrency_limits": [{"key": key, "value": value, "limit": 1} for key, value in TRAINING_TAGS.items()],
})

end_to_end = dg.define_asset_job(
    "end_to_end", selection=dg.AssetSelection.assets(*ALL_ASSETS), executor_def=executor,
    description="Synthetic pool to champion model: curate, validate, version, pretrain, fine-tune x5, evaluate, register, promote.",
)
promote_job = dg.define_asset_job(
    "promote", selection=dg.AssetSelection.assets(champion_models),
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
