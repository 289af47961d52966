"""`keypoint_set: sapiens308` reaches every step: the generator labels 308 points, the label suite
expects 308, and fine-tuning builds a 308-heatmap head whose loss and metric run on those labels."""

from __future__ import annotations

import torch

from pipelines.common.config import load_config
from pipelines.curate import curate
from pipelines.evaluate import _task, score
from pipelines.common.task_models import initial_model
from pipelines.synth import synthesize
from pipelines.validate import validate_curated
from sapiens2.curation import CurationConfig
from sapiens2.data.dataset import CuratedDataset, collate
from sapiens2.model import build_backbone, save_checkpoint


def test_whole_body_keypoints_flow_from_generator_to_metric(tmp_path):
    config = load_config(None, {
        "keypoint_set": "sapiens308", "synth.n_people": 24, "synth.workers": 1, "pretrain.arch": "sapiens2_debug",
    })
    synthesize(tmp_path / "raw", config)
    curate(tmp_path / "raw", tmp_path / "curated", CurationConfig(workers=1, val_fraction=0.4))
    pose = config.task("pose")
    assert pose.num_keypoints == 308

    results = {r.suite: r for r in validate_curated(tmp_path / "curated", num_keypoints=308)}
    assert results["labels_pose"].success, results["labels_pose"].failed
    coco_suite = {r.suite: r for r in validate_curated(tmp_path / "curated", num_keypoints=17)}["labels_pose"]
    assert not coco_suite.success  # the suite really checks the count

    backbone = tmp_path / "backbone.safetensors"
    save_checkpoint(build_backbone("sapiens2_debug", img_size=config.image_size), backbone)
    model = initial_model(config, "pose", backbone)
    height, width = config.image_size
    train = CuratedDataset(tmp_path / "curated", "train", height, width, tasks=("pose",),
                           **config.dataset_keypoints())
    batch = collate([train[i] for i in range(min(4, len(train)))])
    assert batch["keypoints"].shape[1:] == (308, 3)
    heatmaps = model(batch["image"])
    assert heatmaps.shape[1] == 308
    loss, _ = pose.loss(heatmaps, batch)
    loss.backward()
    assert torch.isfinite(loss)

    val = CuratedDataset(tmp_path / "curated", "val", height, width, tasks=("pose",), **config.dataset_keypoints())
    metrics, _ = score(model.eval(), _task("pose", config), val, batch_size=8)
    assert {"AP", "body_AP", "foot_AP", "face_AP", "hands_AP"} <= set(metrics)
