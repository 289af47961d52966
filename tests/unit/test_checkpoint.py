"""Checkpoint IO: exact round trip, reference layouts, wrappers/prefixes, clear mismatch errors."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from sapiens2.model import CheckpointMismatchError, build_backbone, load_checkpoint, save_checkpoint
from sapiens2.model.checkpoint import strip_prefixes


def debug_backbone(seed: int):
    torch.manual_seed(seed)
    return build_backbone("sapiens2_debug", img_size=(64, 48)).eval()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(0))


def prefixed(prefix: str, state: dict) -> dict:
    return {prefix + k: v for k, v in state.items()}


def assert_same_model(a, b, images):
    with torch.no_grad():
        assert torch.equal(a(images, "tokens"), b(images, "tokens"))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_save_and_reload_reproduces_outputs_exactly(tmp_path, images):
    source, target = debug_backbone(0), debug_backbone(1)
    with torch.no_grad():
        assert not torch.allclose(source(images), target(images))
    path = save_checkpoint(source, tmp_path / "weights.safetensors")
    report = load_checkpoint(target, path)
    assert report.missing == [] and report.unexpected == []
    assert_same_model(source, target, images)
    assert target.state_dict()["rope_embed.periods"].dtype == torch.bfloat16


def test_save_requires_safetensors_suffix(tmp_path):
    with pytest.raises(ValueError, match="safetensors"):
        save_checkpoint(debug_backbone(0), tmp_path / "weights.pth")


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda sd: {"state_dict": prefixed("backbone.", sd)}, id="mmengine"),
        pytest.param(lambda sd: {"model": prefixed("module.", sd), "step": 3}, id="ddp"),
        pytest.param(
            lambda sd: {"teacher": prefixed("backbone.", sd), "student": {"x": torch.zeros(1)}},
            id="dino",
        ),
        pytest.param(lambda sd: dict(sd), id="plain"),
    ],
)
def test_reference_layout_pth_loads(tmp_path, images, wrap):
    source, target = debug_backbone(0), debug_backbone(1)
    path = tmp_path / "reference.pth"
    torch.save(wrap(source.state_dict()), path)
    load_checkpoint(target, path)
    assert_same_model(source, target, images)


def test_plain_safetensors_and_task_model_subset_load(tmp_path, images):
    source, target = debug_backbone(0), debug_backbone(1)
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(state, str(tmp_path / "plain.safetensors"))
    load_checkpoint(target, tmp_path / "plain.safetensors")
    assert_same_model(source, target, images)

    # A fine-tuned task model: the backbone part is taken, the head is not the backbone's.
    other = debug_backbone(2)
    task = {"backbone." + k: v.contiguous() for k, v in source.state_dict().items()}
    task["head.conv.weight"] = torch.zeros(4, 64, 1, 1)
    save_file(task, str(tmp_path / "task.safetensors"))
    load_checkpoint(other, tmp_path / "task.safetensors")
    assert_same_model(source, other, images)


def test_missing_key_is_named(tmp_path):
    state = dict(debug_backbone(0).state_dict())
    del state["blocks.2.attn.wk.bias"]
    torch.save({"state_dict": state}, tmp_path / "missing.pth")
    named = r"missing keys \(1\): blocks\.2\.attn\.wk\.bias"
    with pytest.raises(CheckpointMismatchError, match=named) as err:
        load_checkpoint(debug_backbone(1), tmp_path / "missing.pth")
    assert "missing.pth" in str(err.value)
    assert err.value.missing == ["blocks.2.attn.wk.bias"] and err.value.unexpected == []
    assert isinstance(err.value, ValueError)


def test_unexpected_key_is_named_and_non_strict_reports_it(tmp_path):
    target = debug_backbone(1)
    state = {k: v.contiguous() for k, v in debug_backbone(0).state_dict().items()}
    state["blocks.9.attn.wq.weight"] = torch.zeros(64, 64)
    save_file(state, str(tmp_path / "extra.safetensors"))
    named = r"unexpected keys \(1\): blocks\.9\.attn\.wq\.weight"
    with pytest.raises(CheckpointMismatchError, match=named):
        load_checkpoint(target, tmp_path / "extra.safetensors")
    report = load_checkpoint(target, tmp_path / "extra.safetensors", strict=False)
    assert report.unexpected == ["blocks.9.attn.wq.weight"] and report.missing == []
    assert torch.equal(target.cls_token, state["cls_token"])


def test_shape_mismatch_raises_even_when_not_strict(tmp_path):
    state = {k: v.contiguous() for k, v in debug_backbone(0).state_dict().items()}
    state["blocks.1.attn.wk.weight"] = torch.zeros(64, 64)  # a GQA block has 32 output rows
    save_file(state, str(tmp_path / "shape.safetensors"))
    target = debug_backbone(1)
    before = target.blocks[0].attn.wq.weight.clone()
    named = r"blocks\.1\.attn\.wk\.weight: checkpoint \[64, 64\] vs model \[32, 64\]"
    with pytest.raises(CheckpointMismatchError, match=named):
        load_checkpoint(target, tmp_path / "shape.safetensors", strict=False)
    assert torch.equal(target.blocks[0].attn.wq.weight, before)  # nothing half-loaded


def test_pickled_objects_are_refused(tmp_path):
    torch.save({"state_dict": debug_backbone(0).state_dict(), "cfg": pickle.PickleError("x")},
               tmp_path / "unsafe.pth")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(debug_backbone(1), tmp_path / "unsafe.pth")


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint(debug_backbone(0), tmp_path / "nope.safetensors")
    (tmp_path / "weights.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported checkpoint type"):
        load_checkpoint(debug_backbone(0), tmp_path / "weights.ckpt")


def test_strip_prefixes_keeps_matching_names():
    target = {"backbone.cls_token", "head.weight"}
    t = torch.zeros(1)
    # Already matching: a prefix shared by every key is not stripped when that loses matches.
    assert strip_prefixes({"backbone.cls_token": t}, target).keys() == {"backbone.cls_token"}
    wrapped = {"module.backbone.cls_token": t, "module.head.weight": t}
    assert strip_prefixes(wrapped, target).keys() == target
    assert strip_prefixes({}, target) == {}
