"""The evaluation gate travels from the report to the registered version's tags, and promotion
refuses a challenger whose recorded evaluation failed it."""

from __future__ import annotations

from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

from pipelines.common.eval_report import TaskEvaluation
from pipelines.promote import _judge
from pipelines.register import gate_tags


def seg_result(miou: float) -> dict:
    return TaskEvaluation("seg", "mIoU", True, {"mIoU": miou}, {"mIoU": 0.01}, 20,
                          trivial={"class_prior": {"mIoU": 0.10}}, gate_margin=0.02).to_report()


def version(tags: dict[str, str], number: str = "3") -> ModelVersion:
    return ModelVersion("sapiens2-seg", number, 0, tags=[ModelVersionTag(k, v) for k, v in tags.items()])


def test_gate_tags_record_baseline_margin_and_verdict():
    tags = gate_tags(seg_result(0.11))
    assert tags["eval.gate.passed"] == "false" and tags["eval.gate.baseline"] == "trivial:class_prior"
    assert (tags["eval.gate.baseline_value"], tags["eval.gate.margin"]) == ("0.1", "0.02")
    assert tags["eval.trivial.class_prior.mIoU"] == "0.1" and tags["eval.trivial.strongest"] == "class_prior"
    assert gate_tags(seg_result(0.20))["eval.gate.passed"] == "true"
    # A report written before the gate existed (no trivial/gate entries) adds no gate tags.
    assert gate_tags({"primary_metric": "mIoU", "metrics": {"mIoU": 0.2}, "baseline": {"mIoU": 0.0}}) == {}


def test_promotion_refuses_a_challenger_that_failed_the_gate():
    failed = version({"eval.split_id": "s1", "eval.mIoU": "0.11", **gate_tags(seg_result(0.11))})
    promoted, reason = _judge(failed, None, "mIoU", True, "s1")
    assert not promoted
    assert reason.startswith("challenger v3 failed the evaluation gate: mIoU=0.11 does not beat trivial:class_prior")
    passed = version({"eval.split_id": "s1", "eval.mIoU": "0.2", **gate_tags(seg_result(0.20))})
    assert _judge(passed, None, "mIoU", True, "s1")[0]
    untagged = version({"eval.split_id": "s1", "eval.mIoU": "0.2"})  # registered before the gate
    assert _judge(untagged, None, "mIoU", True, "s1")[0]
