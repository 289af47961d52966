"""The evaluation gate (strongest trivial baseline, direction-aware margins) and the report table."""

from __future__ import annotations

import json

import pytest

from pipelines.common.eval_report import TABLE_HEADER, TaskEvaluation, markdown_table, passes_gate


def pose(ap: float, trivial: dict[str, float] | None = None, **kwargs) -> TaskEvaluation:
    trivial = {"mean_skeleton_in_box": 0.25} if trivial is None else trivial
    return TaskEvaluation("pose", "AP", True, {"AP": ap}, {"AP": 0.0}, 10,
                          trivial={n: {"AP": v} for n, v in trivial.items()}, gate_margin=0.02, **kwargs)


def normal(error: float, **kwargs) -> TaskEvaluation:
    trivial = {"constant_mean": {"angular_error_mean": 40.0}, "other": {"angular_error_mean": 32.0}}
    return TaskEvaluation("normal", "angular_error_mean", False, {"angular_error_mean": error},
                          {"angular_error_mean": 110.0}, 10, trivial=trivial, gate_margin=1.0, **kwargs)


def test_a_constant_model_fails_and_a_clear_win_passes():
    constant = pose(0.25)  # scores exactly what the constant template does
    assert constant.margin == 0.0 and not constant.beats_baseline
    assert not pose(0.26).beats_baseline  # better, but by less than the 0.02 margin
    winner = pose(0.30)
    assert winner.beats_baseline and winner.margin == pytest.approx(0.05)
    assert winner.gate_reference == ("trivial:mean_skeleton_in_box", 0.25)


def test_the_strongest_trivial_baseline_is_direction_aware():
    two = pose(0.30, trivial={"a": 0.10, "b": 0.29})
    assert (two.strongest_trivial_name, two.strongest_trivial_value) == ("b", 0.29)
    assert not two.beats_baseline  # beats "a" by far, "b" by only 0.01
    lower = normal(30.5)
    assert (lower.strongest_trivial_name, lower.strongest_trivial_value) == ("other", 32.0)
    assert lower.margin == pytest.approx(1.5) and lower.beats_baseline
    assert not normal(31.5).beats_baseline  # 0.5 deg better than the best constant: below margin
    worse = normal(35.0)
    assert worse.margin == pytest.approx(-3.0) and not worse.beats_baseline


def test_untrained_head_gate_and_zero_margin_ties():
    head_gate = pose(0.05, gate_baseline="untrained_head")
    assert head_gate.gate_reference == ("untrained_head", 0.0) and head_gate.beats_baseline
    assert not pose(0.05).beats_baseline  # the same model against the trivial baseline
    assert not passes_gate(0.3, 0.3, True, 0.0) and passes_gate(0.31, 0.3, True, 0.0)
    assert passes_gate(9.0, 10.0, False, 1.0) and not passes_gate(9.5, 10.0, False, 1.0)
    with pytest.raises(ValueError, match="unknown gate baseline"):
        _ = pose(0.3, gate_baseline="oracle").beats_baseline


def test_report_entry_records_the_gate():
    entry = json.loads(json.dumps(pose(0.30).to_report()))
    assert entry["beats_baseline"] is True and entry["strongest_trivial"] == "mean_skeleton_in_box"
    gate = entry["gate"]
    assert (gate["baseline"], gate["baseline_value"], gate["margin"], gate["passed"]) == \
        ("trivial:mean_skeleton_in_box", 0.25, 0.02, True)
    assert "AP=0.3 beats trivial:mean_skeleton_in_box 0.25 by the margin 0.02" in gate["reason"]
    assert entry["trivial"] == {"mean_skeleton_in_box": {"AP": 0.25}} and entry["scratch"] is None


def test_table_columns_and_from_scratch_cell():
    table = markdown_table([pose(0.30), normal(35.0, scratch={"angular_error_mean": 38.25})])
    header, rule, *rows = table.splitlines()
    assert [c.strip() for c in header.strip("|").split("|")] == list(TABLE_HEADER)
    assert TABLE_HEADER[2:8] == ("fine-tuned", "from scratch (same budget)", "strongest trivial",
                                 "untrained head", "margin", "gate")
    assert rule.count("---") == len(TABLE_HEADER)
    pose_row = [c.strip() for c in rows[0].strip("|").split("|")]
    assert pose_row[3] == "-" and pose_row[4] == "0.2500 (mean_skeleton_in_box)"
    assert pose_row[6].startswith("+0.0500 vs trivial:mean_skeleton_in_box") and pose_row[7] == "pass"
    normal_row = [c.strip() for c in rows[1].strip("|").split("|")]
    assert normal_row[3] == "38.2500" and normal_row[4] == "32.0000 (other)"
    assert normal_row[5] == "110.0000" and normal_row[6].startswith("-3.0000") and normal_row[7] == "FAIL"
