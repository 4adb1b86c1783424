"""Calibration fits efficiencies from a ledger; the advisor remaps only when the gain pays for the transition."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridflow.errors import ConfigError
from hybridflow.placement import Efficiency, advise_remap, fit_efficiency, read_ledger, validate_fragment

from placement_runs import make_run, write_ledger


def test_calibration_recovers_the_efficiency_that_produced_the_ledger(tmp_path: Path) -> None:
    inputs, record = make_run(tmp_path)
    truth = replace(inputs.efficiency, train=0.3, infer=0.4)
    write_ledger(tmp_path, inputs, record, truth)
    fitted, comparisons = fit_efficiency(inputs, record, read_ledger(tmp_path))
    assert fitted.train == pytest.approx(0.3, rel=0.05)
    assert fitted.infer == pytest.approx(0.4, rel=0.05)
    assert {c.node for c in comparisons} >= {"generate", "actor_update", "values"}
    assert all(c.ratio == pytest.approx(1.0, abs=0.05) for c in comparisons)


def _slow_generation() -> Efficiency:
    return replace(Efficiency(), decode_bandwidth=0.15, prefill=0.2)


def test_advisor_declines_when_gain_does_not_pay_for_transition(tmp_path: Path) -> None:
    inputs, record = make_run(tmp_path)
    write_ledger(tmp_path, inputs, record, _slow_generation())
    recommendation = advise_remap(tmp_path, remaining_iterations=1)
    assert recommendation.drift, "generation ran persistently slower than predicted"
    assert recommendation.gain_per_iteration > 0
    assert not recommendation.remap
    assert recommendation.total_gain_seconds < recommendation.transition["total_seconds"]
    line = json.loads((tmp_path / "advisor.jsonl").read_text().splitlines()[-1])
    assert line["remap"] is False and line["transition"]["total_seconds"] > 0
    assert "does not pay" in line["reason"]


def test_advisor_recommends_when_many_iterations_remain(tmp_path: Path) -> None:
    inputs, record = make_run(tmp_path)
    write_ledger(tmp_path, inputs, record, _slow_generation())
    recommendation = advise_remap(tmp_path, remaining_iterations=100_000)
    assert recommendation.remap
    assert recommendation.total_gain_seconds > recommendation.transition["total_seconds"]
    assert recommendation.fragment is not None
    validate_fragment(recommendation.fragment)


def test_advisor_keeps_plan_without_drift(tmp_path: Path) -> None:
    inputs, record = make_run(tmp_path)
    write_ledger(tmp_path, inputs, record, inputs.efficiency)
    recommendation = advise_remap(tmp_path, remaining_iterations=100_000)
    assert not recommendation.remap and not recommendation.drift
    assert (tmp_path / "advisor.jsonl").exists()


def test_missing_ledger_is_a_clear_error(tmp_path: Path) -> None:
    make_run(tmp_path)
    with pytest.raises(ConfigError, match="No ledger"):
        advise_remap(tmp_path, remaining_iterations=10)
