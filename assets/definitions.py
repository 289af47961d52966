"""The Dagster code location: every asset, check, job and resource of the platform."""


import dagster as dg

from assets.curation import curated_dataset, curated_expectations, raw_pool, versioned_dataset
from assets.registry import (champion_models, evaluation_report, every_task_beats_baseline, registered_models,
                             rollback_job)
from assets.resources import DvcResource, PlatformResource
from assets.training import TRAINING_TAGS, finetuned_models, pretrained_backbone

ALL_ASSETS = [raw_pool, curated_dataset, versioned_dataset, pretrained_backbone, *finetuned_models,
              evaluation_report, registered_models, champion_models]
ALL_CHECKS = [curated_expectations, every_task_beats_baseline]

executor = dg.multiprocess_executor.configured({
    "tag_concurrency_limits": [{"key": key, "value": value, "limit": 1} for key, value in TRAINING_TAGS.items()],
})

end_to_end = dg.define_asset_job(
    "end_to_end", selection=dg.AssetSelection.all(), executor_def=executor,
    description="Synthetic pool to champion model: curate, validate, version, pretrain, fine-tune x5, evaluate, register, promote.",
)
promote_job = dg.define_asset_job(
    "promote", selection=dg.AssetSelection.assets(champion_models),
    description="Copy each task's newest version into its production model as champion if it beats the champion there.",
)

defs = dg.Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[end_to_end, promote_job, rollback_job],
    executor=executor,
    resources={
        "platform": PlatformResource(),
        "dvc": DvcResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    },
)
