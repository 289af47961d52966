"""Image-guided heads: the tiny heads join an image pyramid to their upsampling path (the dense
ones also refine with the full-resolution image), the reference heads keep the published layout,
and the albedo head starts from the input image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sapiens2.data.normalize import normalize_images
from sapiens2.data.synth import render_person
from sapiens2.model import build_backbone
from sapiens2.tasks import build_task_model, get_task
from sapiens2.tasks.base import SCALES
from sapiens2.tasks.heads import (
    GUIDED_SCALES,
    PIXEL_SHUFFLE_WIDTHS,
    SEG_WIDTHS,
    DeconvHead,
    ImageGuidance,
    PixelShuffleDecoder,
    build_pixel_shuffle_head,
    denormalize,
)
from sapiens2.tasks.detail import DetailPyramid, join_detail

H, W = 128, 96
GUIDED_TASKS = ("seg", "normal", "albedo", "pointmap")
OUT_CHANNELS = {"seg": 29, "normal": 3, "albedo": 3}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def backbone():
    torch.manual_seed(0)
    return build_backbone("sapiens2_debug", img_size=(H, W)).eval()


def person_images(seeds=(0, 1)) -> torch.Tensor:
    """Rendered people, normalised as the dataset's batches are."""
    images = np.stack([render_person(np.random.default_rng(s), H, W).image for s in seeds])
    return normalize_images(torch.from_numpy(images))


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return person_images()


def task_model(name: str, backbone):
    torch.manual_seed(0)
    return build_task_model(name, backbone).eval()


def dense(output):
    """The head's maps as one tensor; the pointmap head's fresh canonical map is its prior (no
    image in it), so its silhouette is what shows the image reaching it."""
    if isinstance(output, dict):
        return torch.cat([output["pointmap"], output["silhouette_logit"][:, None]], dim=1)
    return output


@pytest.mark.parametrize("name", GUIDED_TASKS)
def test_tiny_dense_models_take_the_image_and_keep_their_shapes(backbone, images, name):
    model = task_model(name, backbone)
    assert model.head.takes_image
    with torch.no_grad():
        out = model(images)
    if name == "pointmap":
        assert out["pointmap"].shape == out["canonical"].shape == (2, 3, H, W)
        assert out["scale"].shape == (2,)
        assert bool((out["scale"] > 0).all())
    else:
        assert out.shape == (2, OUT_CHANNELS[name], H, W)
    assert bool(torch.isfinite(dense(out)).all())


@pytest.mark.parametrize("name", GUIDED_TASKS)
def test_task_model_hands_its_input_image_to_the_head(backbone, images, name):
    model = task_model(name, backbone)
    with torch.no_grad():
        features = model.backbone(images)
        through_model = dense(model(images))
        same_image = dense(model.head(features, images))
        other_image = dense(model.head(features, images.flip(-1)))
    torch.testing.assert_close(through_model, same_image)
    assert not torch.allclose(through_model, other_image, atol=1e-4)


@pytest.mark.parametrize("name", ["seg", "normal", "pointmap"])
def test_changing_the_image_changes_a_guided_head(backbone, images, name):
    # Features fixed: only the guidance sees the change. Albedo is left out: its residual path
    # alone would pass this test.
    model = task_model(name, backbone)
    with torch.no_grad():
        features = model.backbone(images)
        out = dense(model.head(features, images))
        brighter = dense(model.head(features, images + 0.5))
    assert not torch.allclose(out, brighter, atol=1e-4)


@pytest.mark.parametrize("name", GUIDED_TASKS)
def test_guided_head_without_the_image_raises(backbone, images, name):
    model = task_model(name, backbone)
    with torch.no_grad():
        features = model.backbone(images)
        with pytest.raises(ValueError, match="image"):
            model.head(features)


def test_tiny_pose_head_joins_the_image_pyramid_without_full_resolution_guidance(backbone, images):
    model = task_model("pose", backbone)
    assert model.head.takes_image and model.head.guidance is None
    assert isinstance(model.head.detail, DetailPyramid)
    with torch.no_grad():
        features = model.backbone(images)
        out = model(images)
        brighter = model.head(features, images + 0.5)
    assert out.shape == (2, 17, H // 4, W // 4)
    torch.testing.assert_close(out, model.head(features, images))
    assert not torch.allclose(out, brighter, atol=1e-4)


def test_guidance_follows_the_scale():
    for scale in SCALES:
        for name in ("seg", "normal", "albedo", "pointmap", "pose"):
            head = get_task(name).build_head(64, scale)
            head = getattr(head, "decoder", head)  # the pointmap head's canonical-map decoder
            guided = scale in GUIDED_SCALES
            assert head.takes_image is guided, (name, scale)
            assert (head.detail is not None) is guided, (name, scale)
            assert (head.guidance is not None) is (guided and name != "pose"), (name, scale)
    assert GUIDED_SCALES == ("tiny",)


def test_detail_levels_join_the_upsampling_path_at_their_resolution():
    pyramid = DetailPyramid({1: 4, 2: 6, 4: 8})
    levels = pyramid(torch.randn(2, 3, 32, 24))
    assert {size: level.shape[1] for size, level in levels.items()} == {(32, 24): 4, (16, 12): 6, (8, 6): 8}
    x = torch.randn(2, 5, 16, 12)
    joined = join_detail(x, levels)
    assert joined.shape == (2, 11, 16, 12)
    torch.testing.assert_close(joined[:, :5], x)
    assert join_detail(torch.randn(2, 5, 4, 3), levels).shape == (2, 5, 4, 3)  # no level of that size
    with pytest.raises(ValueError, match="doubling"):
        DetailPyramid({1: 4, 4: 8})


def test_reference_heads_keep_the_published_layout():
    head = build_pixel_shuffle_head(768, "reference", 3)
    assert head.takes_image is False
    assert head.out.in_channels == PIXEL_SHUFFLE_WIDTHS["reference"].convs[-1]
    assert not any(isinstance(m, (ImageGuidance, DetailPyramid)) for m in head.modules())
    albedo = get_task("albedo").build_head(768, "reference")
    assert albedo.takes_image is False and albedo.image_residual is False
    assert bool(albedo.out.weight.abs().sum() > 0)  # not the residual head's zero init
    seg = get_task("seg").build_head(768, "reference")
    assert isinstance(seg, DeconvHead) and seg.takes_image is False
    assert seg.out.in_channels == SEG_WIDTHS["reference"].convs[-1]


def test_albedo_residual_head_starts_at_the_input_image(backbone):
    images = person_images((0,))
    model = task_model("albedo", backbone)
    assert model.head.image_residual
    with torch.no_grad():
        out = model(images)
    uint8 = torch.from_numpy(render_person(np.random.default_rng(0), H, W).image)
    expected = uint8.permute(2, 0, 1)[None].float() / 255.0
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0


def test_image_residual_needs_guidance_and_rgb():
    widths = PIXEL_SHUFFLE_WIDTHS["tiny"]
    with pytest.raises(ValueError):
        PixelShuffleDecoder(64, widths, 3, image_guidance=False, image_residual=True)
    with pytest.raises(ValueError):
        PixelShuffleDecoder(64, widths, 4, image_guidance=True, image_residual=True)


def test_denormalize_inverts_the_dataset_normalisation():
    uint8 = torch.randint(0, 256, (2, 8, 6, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    back = denormalize(normalize_images(uint8))
    torch.testing.assert_close(back, uint8.permute(0, 3, 1, 2).float() / 255.0, atol=1e-6, rtol=0)


def test_guidance_resizes_the_image_to_the_features():
    torch.manual_seed(0)
    guidance = ImageGuidance(8)
    features = torch.randn(1, 8, 16, 12)
    image = torch.randn(1, 3, H, W)
    out = guidance(features, image)
    assert out.shape == features.shape
    assert not torch.allclose(out, guidance(features, -image), atol=1e-4)
