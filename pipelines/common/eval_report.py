"""The evaluation report: one task's scores beside its baselines, the gate, and the table.

The gate compares the fine-tuned model's primary metric with a baseline, by default the
strongest trivial one (`sapiens2.tasks.baselines`): an untrained head scores below any constant,
so beating it alone says nothing. A model passes when it is better than that baseline by at
least the task's margin, in the direction of the metric.

A report names the weights it scored (`model_sha256` per task) and nothing about who wrote it, so
the same models on the same split give the same bytes under DVC and Dagster; the MLflow run that
logged it carries `REPORT_TAG` = the report's own sha256 and is found by it (`report_sha256`).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

UNTRAINED_HEAD = "untrained_head"
TRIVIAL = "trivial"
REPORT_TAG = "eval.report_sha256"


def report_sha256(report_file: Path) -> str:
    """sha256 of an evaluation report's bytes: the key of the MLflow run that logged it."""
    return hashlib.sha256(Path(report_file).read_bytes()).hexdigest()


def improvement(value: float, reference: float, higher_is_better: bool) -> float:
    """How much better `value` is than `reference` (negative when worse), in metric units."""
    return value - reference if higher_is_better else reference - value


def passes_gate(value: float, reference: float, higher_is_better: bool, margin: float) -> bool:
    """Better than `reference` by at least `margin`; a tie never passes, even at margin 0."""
    gain = improvement(value, reference, higher_is_better)
    return gain > 0 and gain >= margin


def strongest(scores: dict[str, dict[str, float]], metric: str, higher_is_better: bool) -> str:
    """Name of the best-scoring entry on `metric` (first in order among equals)."""
    if not scores:
        raise ValueError("no baselines to choose the strongest from")
    sign = 1.0 if higher_is_better else -1.0
    return max(scores, key=lambda name: sign * scores[name][metric])


@dataclass(frozen=True)
class TaskEvaluation:
    """Scores of one task on the evaluation split and the gate settings they are judged with.

    `baseline` is the untrained head (same backbone, fresh head), `trivial` the image-blind
    baselines by name, `scratch` an optional from-scratch model trained with the same budget,
    `model_sha256` the scored weights (`pipelines.common.lineage.model_sha256`).
    """

    task: str
    primary_metric: str
    higher_is_better: bool
    metrics: dict[str, float]
    baseline: dict[str, float]
    num_images: int
    trivial: dict[str, dict[str, float]] = field(default_factory=dict)
    scratch: dict[str, float] | None = None
    gate_baseline: str = TRIVIAL
    gate_margin: float = 0.0
    model_sha256: str = ""

    @property
    def value(self) -> float:
        return self.metrics[self.primary_metric]

    @property
    def baseline_value(self) -> float:
        return self.baseline[self.primary_metric]

    @property
    def strongest_trivial_name(self) -> str:
        return strongest(self.trivial, self.primary_metric, self.higher_is_better)

    @property
    def strongest_trivial_value(self) -> float:
        return self.trivial[self.strongest_trivial_name][self.primary_metric]

    @property
    def gate_reference(self) -> tuple[str, float]:
        """(name, primary value) of what the gate compares with, e.g. ("trivial:class_prior", 0.1)."""
        if self.gate_baseline == UNTRAINED_HEAD:
            return UNTRAINED_HEAD, self.baseline_value
        if self.gate_baseline == TRIVIAL:
            return f"{TRIVIAL}:{self.strongest_trivial_name}", self.strongest_trivial_value
        raise ValueError(f"unknown gate baseline {self.gate_baseline!r}; expected {TRIVIAL!r} or {UNTRAINED_HEAD!r}")

    @property
    def margin(self) -> float:
        """The achieved improvement over the gate reference (positive = better)."""
        return improvement(self.value, self.gate_reference[1], self.higher_is_better)

    @property
    def beats_baseline(self) -> bool:
        """Passes the gate: beats the gate reference by at least `gate_margin`."""
        return passes_gate(self.value, self.gate_reference[1], self.higher_is_better, self.gate_margin)

    def gate_record(self) -> dict[str, Any]:
        """What the gate compared and decided, as written to metrics.json and registry tags."""
        name, reference = self.gate_reference
        verdict = "beats" if self.beats_baseline else "does not beat"
        return {
            "baseline": name,
            "baseline_value": reference,
            "margin": self.gate_margin,
            "achieved_margin": self.margin,
            "passed": self.beats_baseline,
            "reason": f"{self.primary_metric}={self.value:.6g} {verdict} {name} {reference:.6g} "
                      f"by the margin {self.gate_margin:g} (achieved {self.margin:+.6g}, "
                      f"{'higher' if self.higher_is_better else 'lower'} is better)",
        }

    def to_report(self) -> dict[str, Any]:
        """The task's entry in metrics.json."""
        return asdict(self) | {
            "strongest_trivial": self.strongest_trivial_name if self.trivial else None,
            "gate": self.gate_record(),
            "beats_baseline": self.beats_baseline,
        }


TABLE_HEADER = ("task", "metric", "fine-tuned", "from scratch (same budget)", "strongest trivial",
                "untrained head", "margin", "gate", "val images")


def markdown_table(results: list[TaskEvaluation]) -> str:
    """One row per task: the model beside each baseline, the achieved/required margin, the gate."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for r in results:
        arrow = "higher" if r.higher_is_better else "lower"
        scratch = "-" if r.scratch is None else f"{r.scratch[r.primary_metric]:.4f}"
        trivial = f"{r.strongest_trivial_value:.4f} ({r.strongest_trivial_name})" if r.trivial else "-"
        margin = f"{r.margin:+.4f} vs {r.gate_reference[0]} (needs {r.gate_margin:g})"
        cells = (r.task, f"{r.primary_metric} ({arrow} is better)", f"{r.value:.4f}", scratch, trivial,
                 f"{r.baseline_value:.4f}", margin, "pass" if r.beats_baseline else "FAIL", str(r.num_images))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
