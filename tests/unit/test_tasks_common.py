"""Shared task behaviour: registry, head shapes at both scales, overfitting, decode/visualize."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sapiens2.tasks import TASK_NAMES, Metric, TaskModel, build_task_model, get_task

H, W = 64, 48  # a 4x3 token grid keeps every test fast


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These graphs are many small ops: extra threads only add contention on a 2-core runner.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_heads():
    """Reference-width heads are large (up to ~50M parameters): build each once."""
    torch.manual_seed(0)
    return {name: get_task(name).build_head(1024, "reference") for name in TASK_NAMES}


class StandInBackbone(nn.Module):
    """Patch-16 conv with the backbone's API: (B, 3, H, W) -> (B, D, H/16, W/16)."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.proj = nn.Conv2d(3, embed_dim, 16, stride=16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def make_batch(b: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    mask = ((xx - W / 2).abs() < W * 0.3) & ((yy - H / 2).abs() < H * 0.4)
    mask = mask.expand(b, H, W).clone()
    keypoints = torch.cat(
        [
            torch.rand(b, 17, 2, generator=g) * torch.tensor([W * 0.8, H * 0.8])
            + torch.tensor([W * 0.1, H * 0.1]),
            torch.full((b, 17, 1), 2.0),
        ],
        -1,
    )
    seg = torch.where(mask, 1 + (yy * 3 / H).long() * 3 + (xx * 3 / W).long(), 0).long()
    fx = torch.tensor([60.0, 45.0])[:b]
    K = torch.zeros(b, 3, 3)
    K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2], K[:, 2, 2] = fx, fx, W / 2, H / 2, 1.0
    z = 2.0 + 0.3 * torch.sin(xx / 7)[None] + 0.1 * torch.arange(b)[:, None, None]
    px = (xx[None] - W / 2) * z / fx[:, None, None]
    py = (yy[None] - H / 2) * z / fx[:, None, None]
    pointmap = torch.stack([px, py, z], 1) * mask[:, None]
    normal = torch.nn.functional.normalize(
        torch.stack([torch.sin(xx / 9), torch.cos(yy / 11), -torch.ones_like(xx)]), dim=0
    )
    albedo = torch.stack([xx / W, yy / H, 0.5 + 0 * xx]).expand(b, 3, H, W) * mask[:, None]
    return {
        "image": torch.randn(b, 3, H, W, generator=g),
        "image_uint8": torch.zeros(b, H, W, 3, dtype=torch.uint8),
        "keypoints": keypoints,
        "seg": seg,
        "mask": mask,
        "normal": normal.expand(b, 3, H, W) * mask[:, None],
        "pointmap": pointmap,
        "albedo": albedo,
        "K": K,
        "bbox": torch.tensor([W * 0.2, H * 0.1, W * 0.8, H * 0.9]).expand(b, 4),
        "id": [f"{i:04d}" for i in range(b)],
    }


def test_task_names_and_registry_errors():
    assert TASK_NAMES == ("pose", "seg", "normal", "pointmap", "albedo")
    with pytest.raises(ValueError, match="unknown task"):
        get_task("depth")
    with pytest.raises(ValueError, match="no setting"):
        get_task("pose", sigmaa=3.0)
    assert get_task("pose", sigma=6.0).sigma == 6.0
    primaries = {n: (get_task(n).primary_metric, get_task(n).higher_is_better) for n in TASK_NAMES}
    assert primaries == {
        "pose": ("AP", True),
        "seg": ("mIoU", True),
        "normal": ("angular_error_mean", False),
        "pointmap": ("canonical_l2_mean", False),
        "albedo": ("psnr", True),
    }


@pytest.mark.parametrize("scale,embed_dim", [("tiny", 64), ("reference", 1024)])
@pytest.mark.parametrize("name", TASK_NAMES)
def test_head_output_shapes(name, scale, embed_dim, reference_heads):
    head = (
        reference_heads[name]
        if scale == "reference"
        else get_task(name).build_head(embed_dim, scale)
    )
    h, w = 2, 3
    with torch.no_grad():
        # The tiny heads take the input image (`DetailPyramid`, `ImageGuidance`); the others ignore it.
        image = torch.randn(2, 3, 16 * h, 16 * w)
        out = head(torch.randn(2, embed_dim, h, w), image) if getattr(head, "takes_image", False) else head(
            torch.randn(2, embed_dim, h, w))
    expected = {"pose": (2, 17, 4 * h, 4 * w), "seg": (2, 29, 16 * h, 16 * w)}
    if name == "pointmap":
        assert out["pointmap"].shape == out["canonical"].shape == (2, 3, 16 * h, 16 * w)
        assert out["scale"].shape == (2,) and bool((out["scale"] > 0).all())
        torch.testing.assert_close(
            out["pointmap"] * out["scale"][:, None, None, None], out["canonical"]
        )
    else:
        assert out.shape == expected.get(name, (2, 3, 16 * h, 16 * w))


def test_reference_widths_follow_the_facts(reference_heads):
    pose = reference_heads["pose"]
    deconvs = [m for m in pose.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert [m.out_channels for m in deconvs] == [1024, 768] and all(m.bias is None for m in deconvs)
    convs = [m.out_channels for m in pose.convs if isinstance(m, nn.Conv2d)]
    assert convs == [512, 512, 256]
    seg = reference_heads["seg"]
    assert [m.out_channels for m in seg.modules() if isinstance(m, nn.ConvTranspose2d)] == [
        512,
        256,
        128,
        64,
    ]
    assert seg.out.out_channels == 29
    normal = reference_heads["normal"]
    shuffles = [m for m in normal.modules() if isinstance(m, nn.PixelShuffle)]
    assert len(shuffles) == 4
    albedo = reference_heads["albedo"]
    assert not any(isinstance(m, nn.InstanceNorm2d) for m in albedo.modules())
    pointmap = reference_heads["pointmap"]
    linears = [m for m in pointmap.scale_branch.mlp if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(6144, 512), (512, 128), (128, 1)]


def test_reference_widths_per_model_size():
    """1b pose and 5b pixel-shuffle heads have their own widths in the facts; built on the meta
    device (shapes only, no memory)."""
    with torch.device("meta"):
        pose_1b = get_task("pose").build_head(1536, "reference")
        pose_08b = get_task("pose").build_head(1280, "reference")
        dense_5b = {name: get_task(name).build_head(2432, "reference") for name in ("normal", "albedo", "pointmap")}
        normal_1b = get_task("normal").build_head(1536, "reference")
    assert [m.out_channels for m in pose_1b.modules() if isinstance(m, nn.ConvTranspose2d)] == [1536, 1024]
    assert [m.out_channels for m in pose_1b.convs if isinstance(m, nn.Conv2d)] == [768, 512, 256]
    assert [m.out_channels for m in pose_08b.modules() if isinstance(m, nn.ConvTranspose2d)] == [1024, 768]
    for name, head in dense_5b.items():
        decoder = head.decoder if name == "pointmap" else head
        before_shuffle = [stage[0].out_channels // 4 for stage in decoder.stages]
        assert all(isinstance(stage[1], nn.PixelShuffle) for stage in decoder.stages), name
        assert before_shuffle == [1536, 768, 512, 256], name
        assert decoder.out.in_channels == 32, name
    assert normal_1b.out.in_channels == 16


def test_build_task_model_picks_scale_from_embed_dim():
    tiny = build_task_model("seg", StandInBackbone(128))
    ref = build_task_model("seg", StandInBackbone(768))
    assert isinstance(tiny, TaskModel)
    assert tiny.head.out.in_channels == 16 and ref.head.out.in_channels == 64
    with pytest.raises(ValueError, match="unknown head scale"):
        build_task_model("seg", StandInBackbone(64), scale="huge")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_loss_decreases_when_overfitting_a_tiny_batch(name):
    torch.manual_seed(0)
    task = get_task(name)
    model = build_task_model(name, StandInBackbone(64))
    batch = make_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(30):
        loss, log = task.loss(model(batch["image"]), batch)
        assert np.isfinite(log["loss"]) and set(log) > {"loss"}
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert min(losses[-5:]) < 0.6 * losses[0], losses


@pytest.mark.parametrize("name", TASK_NAMES)
def test_decode_visualize_and_metric_run_end_to_end(name):
    task = get_task(name)
    model = build_task_model(name, StandInBackbone(64)).eval()
    batch = make_batch()
    pred = task.predict(model, batch["image"])
    outputs = task.decode(pred)
    assert len(outputs) == 2
    image = np.full((H, W, 3), 128, np.uint8)
    picture = task.visualize(image, outputs[0])
    assert picture.dtype == np.uint8 and picture.shape == (H, W, 3)
    metric = task.metric()
    assert isinstance(metric, Metric)
    metric.update(pred, batch)
    result = metric.compute()
    assert task.primary_metric in result and np.isfinite(result[task.primary_metric])


def test_task_models_run_on_the_real_debug_backbone():
    model_pkg = pytest.importorskip("sapiens2.model")
    backbone = model_pkg.build_backbone("sapiens2_debug", img_size=(H, W))
    images = torch.randn(1, 3, H, W)
    with torch.no_grad():
        assert build_task_model("pose", backbone)(images).shape == (1, 17, H // 4, W // 4)
        assert build_task_model("pointmap", backbone)(images)["pointmap"].shape == (1, 3, H, W)


# A perfect prediction of each dense task, in the form its head outputs, made from the batch's labels.
LABELS_AS_PREDICTIONS = {
    "seg": lambda task, b: torch.nn.functional.one_hot(b["seg"], task.num_classes).permute(0, 3, 1, 2).float(),
    "normal": lambda task, b: b["normal"],
    "pointmap": lambda task, b: {"pointmap": b["pointmap"]},
    "albedo": lambda task, b: b["albedo"],
}


@pytest.mark.parametrize("name", TASK_NAMES)
def test_labels_decode_to_the_form_the_predictions_take(name):
    """The prediction grid's "label" column is drawn by `visualize` from `decode_labels`."""
    task = get_task(name)
    batch = make_batch()
    predicted = task.decode(task.predict(build_task_model(name, StandInBackbone(64)).eval(), batch["image"]))
    labels = task.decode_labels(batch)
    assert len(labels) == len(predicted) == 2
    for label, output in zip(labels, predicted, strict=True):
        assert label.shape == output.shape and label.dtype == output.dtype
    image = np.full((H, W, 3), 128, np.uint8)
    assert not np.array_equal(task.visualize(image, labels[0]), image)
    if name in LABELS_AS_PREDICTIONS:  # a prediction equal to the label decodes to the label
        perfect = task.decode(LABELS_AS_PREDICTIONS[name](task, batch))
        for label, output in zip(labels, perfect, strict=True):
            np.testing.assert_allclose(label, output, atol=1e-6)


def test_label_pictures_leave_out_what_is_not_labelled():
    batch = make_batch()
    image = np.full((H, W, 3), 128, np.uint8)
    batch["seg"][:] = 255  # ignored everywhere: drawn as background, the untouched image
    assert np.array_equal(get_task("seg").visualize(image, get_task("seg").decode_labels(batch)[0]), image)
    batch["keypoints"][..., 2] = 0  # no joint labelled: no skeleton drawn
    assert np.array_equal(get_task("pose").visualize(image, get_task("pose").decode_labels(batch)[0]), image)
    batch["mask"][:] = False  # no pixel scored: the label is zero everywhere
    for name in ("normal", "pointmap", "albedo"):
        assert not get_task(name).decode_labels(batch)[0].any(), name
