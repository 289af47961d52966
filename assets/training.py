"""Pretraining and fine-tuning groups: DeepSpeed programs launched through Dagster Pipes.

Each asset starts `python -m pipelines.<step>` (which starts the torchrun ranks), streams rank 0's
log lines and metadata back, then records the output folder with DVC. A new run starts from an
empty folder, as `dvc repro` does; a retry, or a re-execution of a failed or killed run (one with a
parent run), resumes the latest checkpoint when the same recipe, data and world size wrote it, and
otherwise deletes it and starts fresh (`--restart-on-mismatch`). When a
checkpoint store is configured (`$SAPIENS2_CHECKPOINT_STORE`, set by the stack) the final weights
also go to S3 as a verified multipart upload, recorded by a manifest written last.
"""


import shutil
import sys
from pathlib import Path

import dagster as dg

import mlflow

from assets import metadata
from assets.curation import versioned_dataset
from assets.resources import DvcResource, PlatformResource
from pipelines.common import s3 as s3store
from pipelines.common import tracking
from pipelines.common.config import TASK_NAMES

TRAINING_RETRY = dg.RetryPolicy(max_retries=1, delay=10)
# `training_slots()` training programs at a time, each rank on its share of the node's cores
# (pipelines.common.launch). The `training` pool enforces it across runs (dagster.yaml); this op
# tag lets the run's executor enforce it within one.
TRAINING_TAGS = {"sapiens2/kind": "training"}
# Pretraining first (five fine-tunings wait for it), then the longest fine-tunings (the demo: seg
# 600 steps of a full-resolution head, pose 450 steps, pointmap 200), so the two slots finish
# together instead of one long run ending alone.
PRETRAINING_PRIORITY = 4
TASK_PRIORITY = {"seg": 3, "pose": 2, "pointmap": 1}


def task_op_tags(task: str) -> dict[str, str]:
    return {**TRAINING_TAGS, "dagster/priority": str(TASK_PRIORITY.get(task, 0))}


def launch(context: dg.AssetExecutionContext, client: dg.PipesSubprocessClient, platform: PlatformResource,
           module: str, output: Path, args: list[str]) -> dict:
    """Run a training program for this asset; returns the metadata its rank 0 reported."""
    if context.retry_number == 0 and context.run.parent_run_id is None:
        shutil.rmtree(output, ignore_errors=True)
    config_file = platform.write_config(output / "config.yaml")
    command = [sys.executable, "-m", module, *args, "--output", str(output), "--config", str(config_file),
               "--restart-on-mismatch"]
    env = {"DAGSTER_RUN_ID": context.run.run_id, "SAPIENS2_WORKSPACE": str(platform.ws.root)}
    result = client.run(command=command, context=context, env=env, cwd=str(platform.ws.root))
    return dict(result.get_materialize_result().metadata)


def _value(entry) -> str:
    """A reported metadata entry as text (Pipes hands back MetadataValue objects)."""
    return str(getattr(entry, "value", entry) or "")


def publish_checkpoint(context: dg.AssetExecutionContext, platform: PlatformResource, files: list[Path],
                       name: str, mlflow_run_id: str = "") -> dict:
    """Upload `files` to the checkpoint store under `<name>/<dagster run id>/`; {} when none is set.

    Nothing is recorded (metadata, MLflow tag) unless every file was verified and the manifest
    written; an outage beyond the client's retries fails the step, whose retry policy reruns it.
    """
    settings = s3store.checkpoint_store()
    if settings is None:
        return {}
    ckpt = s3store.publish_checkpoint(files, f"{name}/{context.run.run_id}", settings,
                                      extra={"asset": context.asset_key.to_user_string(),
                                             "dagster_run_id": context.run.run_id, "mlflow_run_id": mlflow_run_id})
    context.log.info(f"checkpoint {ckpt.uri}: {len(ckpt.files)} files, "
                     f"{sum(f.size for f in ckpt.files):,} bytes verified")
    if mlflow_run_id:
        uri = tracking.tracking_uri_for(platform.ws.root)
        mlflow.MlflowClient(tracking_uri=uri).set_tag(mlflow_run_id, "checkpoint.uri", ckpt.uri)
    return {"checkpoint_uri": dg.MetadataValue.text(ckpt.uri),
            "checkpoint_sha256": dg.MetadataValue.text(ckpt.files[0].sha256)}


@dg.asset(
    group_name="pretraining", deps=[versioned_dataset], pool="training", retry_policy=TRAINING_RETRY,
    op_tags={**TRAINING_TAGS, "dagster/priority": str(PRETRAINING_PRIORITY)},
    kinds={"pytorch", "deepspeed", "dvc"},
)
def pretrained_backbone(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource,
                        pipes_subprocess_client: dg.PipesSubprocessClient) -> dg.MaterializeResult:
    """The Sapiens2 backbone pretrained with MAE + CLS self-distillation under DeepSpeed ZeRO."""
    ws = platform.ws
    reported = launch(context, pipes_subprocess_client, platform, "pipelines.pretrain", ws.pretrain_dir,
                      ["--curated", str(ws.curated_dir)])
    md5 = dvc.commit(ws, "pretrain", ws.pretrain_dir)
    stored = publish_checkpoint(context, platform, [ws.pretrain_dir / "backbone.safetensors", ws.pretrain_dir / "backbone.json"],
                                "pretrain", _value(reported.get("mlflow_run_id")))
    recon = ws.pretrain_dir / "mae_reconstruction.png"  # absent when the MAE term is off
    return dg.MaterializeResult(
        metadata={
            **reported, "dvc_md5": md5, **stored,
            "loss_curves": metadata.image(ws.pretrain_dir / "loss_curves.png", "losses"),
            **({"mae_reconstruction": metadata.image(recon, "MAE")} if recon.exists() else {}),
        },
        data_version=dg.DataVersion(md5),
    )


def finetune_asset(task: str) -> dg.AssetsDefinition:
    """The fine-tuning asset of one task (one per task, so the UI shows five)."""

    @dg.asset(
        name=f"finetuned_{task}", group_name="finetuning", deps=[pretrained_backbone, versioned_dataset],
        pool="training", retry_policy=TRAINING_RETRY, op_tags=task_op_tags(task), kinds={"pytorch", "deepspeed", "dvc"},
        description=f"The {task} head fine-tuned on the pretrained backbone (layer-wise lr decay).",
    )
    def _finetuned(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource,
                   pipes_subprocess_client: dg.PipesSubprocessClient) -> dg.MaterializeResult:
        ws = platform.ws
        out = ws.task_dir(task)
        reported = launch(context, pipes_subprocess_client, platform, "pipelines.finetune", out,
                          ["--task", task, "--curated", str(ws.curated_dir), "--backbone", str(ws.pretrain_dir)])
        md5 = dvc.commit(ws, f"finetune@{task}", out)
        stored = publish_checkpoint(context, platform, [out / "model.safetensors", out / "model.json"], f"finetune/{task}",
                                    _value(reported.get("mlflow_run_id")))
        return dg.MaterializeResult(
            metadata={**reported, "dvc_md5": md5, **stored, "loss_curve": metadata.image(out / "loss_curves.png", "loss")},
            data_version=dg.DataVersion(md5),
        )

    return _finetuned


def scratch_asset(task: str) -> dg.AssetsDefinition:
    """The from-scratch control of one task: the fine-tuning recipe on a random backbone."""

    @dg.asset(
        name=f"scratch_{task}", group_name="controls", deps=[versioned_dataset],
        pool="training", retry_policy=TRAINING_RETRY, op_tags=task_op_tags(task), kinds={"pytorch", "deepspeed", "dvc"},
        description=f"The {task} model trained from a randomly initialised backbone with the same budget: "
                    "the control that shows what pretraining adds.",
    )
    def _scratch(context: dg.AssetExecutionContext, platform: PlatformResource, dvc: DvcResource,
                 pipes_subprocess_client: dg.PipesSubprocessClient) -> dg.MaterializeResult:
        ws = platform.ws
        out = ws.scratch_dir(task)
        reported = launch(context, pipes_subprocess_client, platform, "pipelines.finetune", out,
                          ["--task", task, "--curated", str(ws.curated_dir), "--from-scratch"])
        md5 = dvc.commit(ws, f"scratch@{task}", out)
        return dg.MaterializeResult(
            metadata={**reported, "dvc_md5": md5, "loss_curve": metadata.image(out / "loss_curves.png", "loss")},
            data_version=dg.DataVersion(md5),
        )

    return _scratch


finetuned_models = [finetune_asset(task) for task in TASK_NAMES]
scratch_models = [scratch_asset(task) for task in TASK_NAMES]
