"""Model-backed curation stages loaded from configured files (local or S3), never downloaded:
a tiny open_clip model (clip_filter, realism, aesthetic, the clip embedder) and a tiny ONNX
"person" detector, both built and exported here, run through the real ``FilterChain``."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from skimage import data as skimage_data

from pipelines.common import s3 as s3mod
from pipelines.common.model_cache import fetch_model, fetch_remote_models
from sapiens2.curation import CurationConfig, FilterChain, decode_image
from sapiens2.curation.clip import import_open_clip, load_clip
from sapiens2.curation.config import (AestheticConfig, ClipConfig, ClipModelConfig, EmbeddingConfig,
                                      OnnxDetectorConfig)
from sapiens2.curation.stages import build_stages
from sapiens2.model.checkpoint import save_checkpoint
from tests.integration.test_s3_upload import moto_s3  # noqa: F401  (fixture: moto S3 on a loopback port)

TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "patch_size": 8, "layers": 2, "width": 64},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}
NAME = "sapiens2-tiny-clip-test"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> dict:
    """A seeded tiny CLIP saved as safetensors, its architecture JSON, and the model itself."""
    open_clip = import_open_clip()
    root = tmp_path_factory.mktemp("clip")
    arch = root / f"{NAME}.json"
    arch.write_text(json.dumps(TINY_CLIP))
    torch.manual_seed(0)
    model = open_clip.CLIP(**TINY_CLIP).eval()
    checkpoint = save_checkpoint(model, root / "tiny_clip.safetensors")
    return {"arch": str(arch), "checkpoint": str(checkpoint), "model": model, "root": root}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    """scikit-image's packaged astronaut (a person) and coffee (no person) as PNG files."""
    root = tmp_path_factory.mktemp("photos")
    paths = {}
    for name in ("astronaut", "coffee"):
        paths[name] = root / f"{name}.png"
        Image.fromarray(getattr(skimage_data, name)()[..., :3]).save(paths[name])
    return paths


def _clip(tiny_clip: dict, **update) -> ClipConfig:
    return ClipConfig(**{"model_name": NAME, "arch_config": tiny_clip["arch"], "checkpoint": tiny_clip["checkpoint"],
                         **update})


def _model(tiny_clip: dict):
    return load_clip(_clip(tiny_clip), "curation.clip", "test")


def _embeddings(tiny_clip: dict, photos: dict[str, Path]) -> dict[str, np.ndarray]:
    return {name: _model(tiny_clip).embed_images([decode_image(path, 10**8).image])[0] for name, path in photos.items()}


def _chain(stages: tuple[str, ...], **update) -> FilterChain:
    return FilterChain(CurationConfig(stages=("size", "phash", *stages), workers=1, **update))


# ---- CLIP -----------------------------------------------------------------------------------


def test_clip_loads_the_checkpoint_once_and_embeds_deterministically(tiny_clip, photos):
    model = _model(tiny_clip)
    assert model is _model(tiny_clip)  # one model per process per (architecture, checkpoint)
    saved = tiny_clip["model"].state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.model.state_dict().items())
    images = [decode_image(path, 10**8).image for path in photos.values()]
    first = model.embed_images(images)
    again = model.embed_images([image.copy() for image in images])  # new arrays: encoded afresh
    assert first.shape == (2, 32) and np.array_equal(first, again)
    assert np.allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-5)
    batch = torch.stack([model.preprocess(Image.fromarray(image)) for image in images])
    with torch.no_grad():
        reference = tiny_clip["model"].encode_image(batch, normalize=True).numpy()
    assert np.allclose(first, reference, atol=1e-5) and model.image_side == 32


def test_clip_filter_keeps_the_positive_prototype_and_rejects_the_negative(tiny_clip, photos, tmp_path):
    emb = _embeddings(tiny_clip, photos)
    np.save(tmp_path / "pos.npy", emb["astronaut"])
    np.save(tmp_path / "neg.npy", emb["coffee"][None])
    clip = _clip(tiny_clip, positive_prompts=(), negative_prompts=(), positive_prototypes=str(tmp_path / "pos.npy"),
                 negative_prototypes=str(tmp_path / "neg.npy"))
    astronaut, coffee = _chain(("clip_filter",), clip=clip).assess_batch([photos["astronaut"], photos["coffee"]])
    assert astronaut["status"] == "kept" and astronaut["clip_positive"] == pytest.approx(1.0, abs=1e-5)
    assert astronaut["clip_margin"] > 0
    assert (coffee["status"], coffee["reason"]) == ("rejected", "clip_negative")
    assert coffee["clip_negative"] == pytest.approx(1.0, abs=1e-5) and coffee["detail"].startswith("CLIP margin")
    # Prompts add text-tower prototypes to the same lists.
    with_prompts = _chain(("clip_filter",), clip=clip.model_copy(update={"negative_prompts": ("a photo of a cup",)}))
    row = with_prompts.assess(photos["astronaut"])
    text = _model(tiny_clip).embed_texts(("a photo of a cup",))[0]
    expected = max(float(emb["astronaut"] @ emb["coffee"]), float(emb["astronaut"] @ text))
    assert row["clip_negative"] == pytest.approx(expected, abs=1e-5)
    np.save(tmp_path / "bad.npy", np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"curation.clip.negative_prototypes: .*bad.npy has shape \(2, 5\)"):
        _chain(("clip_filter",), clip=clip.model_copy(update={"negative_prototypes": str(tmp_path / "bad.npy")}))


def test_realism_is_the_photo_prompts_softmax_share(tiny_clip, photos):
    clip = _clip(tiny_clip, photo_prompts=("a photo",), non_photo_prompts=("a cartoon", "a painting"))
    rows = _chain(("realism",), clip=clip).assess_batch(list(photos.values()))
    model = _model(tiny_clip)
    emb = np.stack(list(_embeddings(tiny_clip, photos).values()))
    logits = np.exp(model.logit_scale * emb @ model.embed_texts(("a photo", "a cartoon", "a painting")).T)
    expected = logits[:, 0] / logits.sum(axis=1)
    assert [r["realism"] for r in rows] == pytest.approx(expected.tolist(), abs=1e-5)
    strict = _chain(("realism",), clip=clip.model_copy(update={"min_realism": 1.0}))
    assert {r["reason"] for r in strict.assess_batch(list(photos.values()))} == {"not_realistic"}
    lenient = _chain(("realism",), clip=clip.model_copy(update={"min_realism": 0.0}))
    assert {r["status"] for r in lenient.assess_batch(list(photos.values()))} == {"kept"}


def test_aesthetic_heads_give_the_hand_computed_score(tiny_clip, photos, tmp_path):
    emb = _embeddings(tiny_clip, photos)
    linear = tmp_path / "linear.safetensors"
    save_file({"weight": torch.from_numpy(10 * emb["astronaut"][None]), "bias": torch.tensor([1.0])}, linear)
    cosine = float(emb["astronaut"] @ emb["coffee"])
    threshold = 1 + 10 * (1 + cosine) / 2  # between the astronaut's 11 and the coffee's 1 + 10 cos
    chain = _chain(("aesthetic",), clip=_clip(tiny_clip),
                   aesthetic=AestheticConfig(head=str(linear), min_score=threshold))
    astronaut, coffee = chain.assess_batch([photos["astronaut"], photos["coffee"]])
    assert astronaut["aesthetic"] == pytest.approx(11.0, abs=1e-4) and astronaut["status"] == "kept"
    assert coffee["aesthetic"] == pytest.approx(1 + 10 * cosine, abs=1e-4)
    assert (coffee["status"], coffee["reason"]) == ("rejected", "low_aesthetic")
    # LAION's improved predictor layout: layers.<i> in index order, no activation between.
    rng = np.random.default_rng(0)
    w0, b0, w2, b2 = (rng.normal(size=s).astype(np.float32) for s in ((4, 32), (4,), (1, 4), (1,)))
    mlp = tmp_path / "mlp.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in {"layers.0.weight": w0, "layers.0.bias": b0,
                                                    "layers.2.weight": w2, "layers.2.bias": b2}.items()}, mlp)
    stage = build_stages(CurationConfig(stages=("size", "phash", "aesthetic"), clip=_clip(tiny_clip),
                                        aesthetic=AestheticConfig(head=str(mlp))))[-1]
    image = decode_image(photos["coffee"], 10**8).image
    expected = float(((emb["coffee"] @ w0.T + b0) @ w2.T + b2)[0])
    assert stage.score([image])["aesthetic"][0] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("tensors, message", [
    ({"w": torch.zeros(1, 32), "b": torch.zeros(1)}, r"wrong.safetensors: missing key 'weight'"),
    ({"weight": torch.zeros(1, 32)}, r"wrong.safetensors: missing key 'bias'"),
    ({"weight": torch.zeros(1, 768), "bias": torch.zeros(1)}, r"wrong.safetensors: 'weight' \(1, 768\).*size 32"),
    ({"layers.0.weight": torch.zeros(3, 32), "layers.0.bias": torch.zeros(3)}, r"'layers.0.weight' has 3 outputs"),
])
def test_a_wrong_aesthetic_head_names_the_file_and_key(tiny_clip, tmp_path, tensors, message):
    save_file(tensors, tmp_path / "wrong.safetensors")
    config = CurationConfig(stages=("size", "phash", "aesthetic"), clip=_clip(tiny_clip),
                            aesthetic=AestheticConfig(head=str(tmp_path / "wrong.safetensors")))
    with pytest.raises(ValueError, match=rf"curation.aesthetic.head: .*{message}"):
        build_stages(config)


def test_clip_stages_and_embedder_share_one_forward_pass_per_image(tiny_clip, photos, tmp_path):
    save_file({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, tmp_path / "head.safetensors")
    clip = _clip(tiny_clip, min_margin=-2.0, min_realism=0.0)
    model_config = ClipModelConfig(model_name=NAME, arch_config=tiny_clip["arch"], checkpoint=tiny_clip["checkpoint"])
    chain = _chain(("clip_filter", "realism", "aesthetic"), clip=clip,
                   aesthetic=AestheticConfig(head=str(tmp_path / "head.safetensors"), min_score=-1.0),
                   embedding=EmbeddingConfig(embedder="clip", clip=model_config, near_dup_cosine=0.99))
    model, before = _model(tiny_clip), _model(tiny_clip).images_encoded
    rows = chain.assess_batch(list(photos.values()))
    assert model.images_encoded - before == 2  # three stages and the embedder, one pass per image
    assert [r["status"] for r in rows] == ["kept", "kept"]
    assert all(r["clip_margin"] is not None and r["realism"] is not None and r["aesthetic"] == 0.0 for r in rows)
    expected = _embeddings(tiny_clip, photos)
    assert np.allclose(rows[0]["_embedding"], expected["astronaut"], atol=1e-6)


def test_a_pickled_checkpoint_with_code_is_refused_without_running_it(tiny_clip, tmp_path):
    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    torch.save({"state_dict": tiny_clip["model"].state_dict(), "meta": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        build_stages(CurationConfig(stages=("size", "phash", "realism"),
                                    clip=_clip(tiny_clip, checkpoint=str(tmp_path / "evil.pt"))))
    assert not (tmp_path / "ran").exists()
    torch.save(tiny_clip["model"].state_dict(), tmp_path / "plain.pt")  # a plain state dict loads
    assert load_clip(_clip(tiny_clip, checkpoint=str(tmp_path / "plain.pt")), "curation.clip", "test").dim == 32


@pytest.mark.parametrize("update, message", [
    ({"stages": ("size", "phash", "clip_filter")}, r"curation.clip.checkpoint is required by stage 'clip_filter'"),
    ({"stages": ("size", "phash", "realism")}, r"curation.clip.checkpoint is required by stage 'realism'"),
    ({"stages": ("size", "phash", "aesthetic")}, r"curation.aesthetic.head is required by stage 'aesthetic'"),
    ({"stages": ("size", "phash", "onnx_person")}, r"curation.onnx_person.model is required by stage 'onnx_person'"),
    ({"stages": ("size", "phash"), "embedding": EmbeddingConfig(embedder="clip", near_dup_cosine=0.9)},
     r"curation.embedding.clip.checkpoint is required by embedder 'clip'"),
    ({"stages": ("size", "phash", "clip_filter"), "clip": ClipConfig(checkpoint="/nowhere/clip.safetensors")},
     r"curation.clip.checkpoint: model file /nowhere/clip.safetensors does not exist"),
    ({"clip": {"model_name": "hf-hub:org/model"}}, r"(?s)clip.model_name.*'hf-hub:' models download at run time"),
])
def test_missing_model_files_name_the_config_field(update, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        FilterChain(CurationConfig(**update))


# ---- ONNX person detector -------------------------------------------------------------------


class BrightBox(torch.nn.Module):
    """A stand-in detector: one class-0 box around the pixels brighter than 0.8, scored by their
    share of the input. Rows are [x1, y1, x2, y2, score, class] in input pixels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.mean(1) > 0.8
        cols, rows = mask.any(1), mask.any(2)
        xs = torch.arange(x.shape[3], dtype=x.dtype).expand_as(cols.to(x.dtype))
        ys = torch.arange(x.shape[2], dtype=x.dtype).expand_as(rows.to(x.dtype))
        x1 = torch.where(cols, xs, torch.full_like(xs, 1e4)).amin(1)
        x2 = torch.where(cols, xs + 1, torch.zeros_like(xs)).amax(1)
        y1 = torch.where(rows, ys, torch.full_like(ys, 1e4)).amin(1)
        y2 = torch.where(rows, ys + 1, torch.zeros_like(ys)).amax(1)
        score = mask.to(x.dtype).mean((1, 2))
        return torch.stack([x1, y1, x2, y2, score, torch.zeros_like(score)], 1).unsqueeze(1)


def _export(path: Path, side: int, dynamic_batch: bool) -> Path:
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated; this plain graph needs no more
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(BrightBox(), (torch.zeros(1, 3, side, side),), str(path), dynamo=False,
                          input_names=["images"], output_names=["boxes"],
                          dynamic_axes={"images": {0: "n"}, "boxes": {0: "n"}} if dynamic_batch else None)
    return path


@pytest.fixture(scope="module")
def bright_onnx(tmp_path_factory) -> Path:
    return _export(tmp_path_factory.mktemp("onnx") / "bright.onnx", 64, dynamic_batch=True)


def _scene(shape: tuple[int, int], rect: tuple[slice, slice] | None) -> np.ndarray:
    image = np.full((*shape, 3), 30, np.uint8)
    image += np.random.default_rng(shape[0]).integers(0, 20, image.shape, dtype=np.uint8)  # some texture
    if rect is not None:
        image[rect] = 235
    return image


SCENES = {  # name -> (image, bright-box area fraction)
    "wide": (_scene((200, 300), (slice(50, 150), slice(60, 240))), 100 * 180 / (200 * 300)),
    "dark": (_scene((120, 90), None), 0.0),
    "tall": (_scene((160, 90), (slice(0, 80), slice(45, 90))), 80 * 45 / (160 * 90)),
}


def test_onnx_person_keeps_bright_boxes_rejects_dark_and_maps_boxes_back(bright_onnx, tmp_path):
    paths = []
    for name, (image, _) in SCENES.items():
        paths.append(tmp_path / f"{name}.png")
        Image.fromarray(image).save(paths[-1])
    detector = OnnxDetectorConfig(model=str(bright_onnx), input_size=64, min_score=0.05, min_area_fraction=0.1)
    rows = _chain(("onnx_person",), onnx_person=detector).assess_batch(paths)  # mixed sizes, one ORT call
    assert [(r["status"], r["reason"]) for r in rows] == [("kept", None), ("rejected", "no_person"), ("kept", None)]
    assert [r["det_persons"] for r in rows] == [1, 0, 1]
    for row, (_, area) in zip(rows, SCENES.values()):
        assert row["det_person_area"] == pytest.approx(area, abs=0.03)
    assert rows[1]["det_score"] == 0.0 and rows[0]["det_score"] > 0.05
    assert rows[1]["detail"].startswith("no person box with score >= 0.05")
    # Another class id counts nothing; a fixed batch-1 export runs the batch in chunks, same boxes.
    images = [image for image, _ in SCENES.values()]
    config = CurationConfig(stages=("size", "phash", "onnx_person"), onnx_person=detector)
    stage = build_stages(config)[-1]
    assert stage.input_side == 64
    other = build_stages(config.model_copy(update={"onnx_person": detector.model_copy(update={"person_class": 1})}))
    assert other[-1].score(images)["det_persons"] == [0, 0, 0]
    single = _export(tmp_path / "single.onnx", 64, dynamic_batch=False)
    chunked = build_stages(config.model_copy(update={"onnx_person": detector.model_copy(
        update={"model": str(single)})}))[-1]
    assert chunked.detector.fixed_batch == 1 and chunked.score(images) == stage.score(images)
    with pytest.raises(ValueError, match=r"single.onnx: input 'images' has shape \[1, 3, 64, 64\].*input_size=96"):
        build_stages(config.model_copy(update={"onnx_person": detector.model_copy(
            update={"model": str(single), "input_size": 96})}))


# ---- S3 -------------------------------------------------------------------------------------


def test_models_load_from_s3_once_and_the_cache_is_reused(moto_s3, tiny_clip, bright_onnx, photos, tmp_path,  # noqa: F811
                                                          monkeypatch):
    moto, settings = moto_s3
    for key, value in settings.aws_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SAPIENS2_MODEL_CACHE", str(tmp_path / "cache"))
    clip_uri = s3mod.upload_verified(tiny_clip["checkpoint"], "models/tiny_clip.safetensors", settings).uri
    onnx_uri = s3mod.upload_verified(bright_onnx, "models/bright.onnx", settings).uri
    remote = CurationConfig(stages=("size", "phash", "realism", "onnx_person"), workers=1,
                            clip=_clip(tiny_clip, checkpoint=clip_uri, min_realism=0.0),
                            onnx_person=OnnxDetectorConfig(model=onnx_uri, input_size=64))
    # The library opens local files only and says where remote ones are fetched.
    with pytest.raises(ValueError, match=r"curation\.\w+\.\w+: s3://.* is remote; .*fetch_remote_models"):
        FilterChain(remote)
    local = fetch_remote_models(remote)
    chain = FilterChain(local)
    cached = tmp_path / "cache" / settings.bucket / "team/run1/models/tiny_clip.safetensors"
    assert cached.read_bytes() == Path(tiny_clip["checkpoint"]).read_bytes()
    assert local.clip.checkpoint == str(cached) and local.onnx_person.model.endswith("/models/bright.onnx")
    assert (tmp_path / "cache" / settings.bucket / "team/run1/models/bright.onnx").is_file()
    assert sorted(p.name for p in cached.parent.iterdir() if not p.name.startswith(".")) == [
        "bright.onnx", "tiny_clip.safetensors"]
    assert not list(cached.parent.glob("*.partial"))
    row = chain.assess(photos["astronaut"])
    assert row["realism"] is not None and row["det_score"] is not None
    # Republished under the same key: the next fetch sees the new ETag and downloads it again.
    republished = tmp_path / "republished.safetensors"
    republished.write_bytes(Path(tiny_clip["checkpoint"]).read_bytes() + b"\0")
    s3mod.upload_verified(republished, "models/tiny_clip.safetensors", settings)
    assert fetch_model(clip_uri, field="curation.clip.checkpoint") == cached
    assert cached.read_bytes() == republished.read_bytes()
    moto.stop()  # offline now: the cached file answers without S3
    try:
        assert fetch_model(clip_uri, field="curation.clip.checkpoint") == cached
    finally:
        moto.start()
    with pytest.raises(FileNotFoundError, match=r"curation.clip.checkpoint: s3://.*/missing.safetensors does not exist"):
        fetch_model(f"s3://{settings.bucket}/missing.safetensors", field="curation.clip.checkpoint")
    # A download that does not match the object's recorded sha256 never lands in the cache.
    s3mod.client(settings).put_object(Bucket=settings.bucket, Key="models/bad.onnx", Body=b"not a model",
                                      Metadata={"sha256": "0" * 64})
    with pytest.raises(s3mod.UploadVerificationError, match="model: download of .*bad.onnx failed verification"):
        fetch_model(f"s3://{settings.bucket}/models/bad.onnx")
    assert not list((tmp_path / "cache" / settings.bucket / "models").iterdir())


def test_curation_with_s3_models_filters_in_process(moto_s3, bright_onnx, photos, tmp_path, monkeypatch):  # noqa: F811
    """With one worker the chain runs in the curating process, which must build it from the fetched
    local copies, not from the s3:// names the library refuses to open."""
    from pipelines.curate import curate

    _, settings = moto_s3
    for key, value in settings.aws_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SAPIENS2_MODEL_CACHE", str(tmp_path / "cache"))
    onnx_uri = s3mod.upload_verified(bright_onnx, "models/bright.onnx", settings).uri
    config = CurationConfig(stages=("size", "phash", "onnx_person"), workers=1,
                            onnx_person=OnnxDetectorConfig(model=onnx_uri, input_size=64))
    summary = curate(photos["astronaut"].parent, tmp_path / "curated", config)
    assert summary.n_inputs == 2
    assert sum(summary.status_counts.values()) == 2 and summary.status_counts["quarantined"] == 0
