"""Calibration and the remap advisor on ledgers measured on this box, not produced by the simulator.

``data/measured_ppo_seed0/*.jsonl`` are the trainer's own ledgers (trimmed to iteration, seconds and per-node
seconds / busy_seconds) of PPO on the tiny Qwen2 preset with four models on 4 CPU slots sharing 2 cores, one run
per placement (``bench/placement_validation.py --seeds 0``; row 0 is the warm-up). Colocated, every model ran at
data-parallel size 4; standalone, at 1.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from hybridflow.errors import ConfigError
from hybridflow.placement.advisor import RemapCosts, RunAdvisor, advise_remap, decide_remap
from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import fit_efficiency_to_runs, read_ledger
from hybridflow.placement.record import PlanInputs, PlanRecord, retime_plan, save_plan_record
from hybridflow.testing.placement_runs import PLACEMENTS, data_parallel_record, tiny_ppo_inputs

DATA = Path(__file__).parent / "data" / "measured_ppo_seed0"
MEASURED = ("colocate", "standalone", "split-a_crw")  # the saved runs (file names: "_" for the bench's "|")
SETUP_SECONDS = {"colocate": 134.6, "standalone": 144.2}  # the runs' measured start-up (measured.json)


def _inputs(cores: float | None = 2) -> PlanInputs:
    return tiny_ppo_inputs(cores=cores)


def _record(name: str) -> PlanRecord:
    """The saved rows' file name (``split-a_crw``) → the bench's placement (``split-a|crw``), data-parallel only."""
    return data_parallel_record(*PLACEMENTS[name.replace("_", "|")])


def _rows(name: str) -> list[dict]:
    return read_ledger(DATA / f"{name}.jsonl")


def _measured_iteration(name: str) -> float:
    return statistics.median(row["seconds"] for row in _rows(name)[1:])


def _predicted(inputs: PlanInputs, name: str, efficiency=None) -> float:  # type: ignore[no-untyped-def]
    usable = inputs.cluster.device.memory_bytes * 0.9
    planner = LayoutPlanner(inputs.simulator(efficiency), inputs.dataflow, inputs.models)
    return retime_plan(planner, _record(name), usable).iteration_seconds


def _run_dir(tmp_path: Path, name: str, rows: int | None = None) -> Path:
    inputs = _inputs()
    run_dir = tmp_path / name
    run_dir.mkdir()
    usable = inputs.cluster.device.memory_bytes * 0.9
    plan = retime_plan(LayoutPlanner(inputs.simulator(), inputs.dataflow, inputs.models), _record(name), usable)
    save_plan_record(run_dir / "plan.json", inputs, plan)
    lines = (DATA / f"{name}.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "ledger.jsonl").write_text("".join(lines[:rows]))
    return run_dir


def test_two_measured_data_parallel_sizes_calibrate_a_model_that_orders_a_held_out_placement() -> None:
    inputs = _inputs()
    runs = [(_record(n), _rows(n)[1:]) for n in ("colocate", "standalone")]
    fitted, comparisons = fit_efficiency_to_runs(inputs, runs)
    # measured: the same tiny model is slower on 4 ranks than on 1, which only the sync latency or the stall of
    # collectives on shared cores can explain
    assert fitted.sync_latency_seconds > 1e-4 or fitted.collective_stall > 0.1
    assert all(0.3 < c.ratio < 3 for run in comparisons for c in run)
    held_out = {n: _predicted(inputs, n, fitted) for n in MEASURED}
    measured = {n: _measured_iteration(n) for n in MEASURED}
    assert sorted(held_out, key=held_out.__getitem__) == sorted(measured, key=measured.__getitem__)
    # the 4 slots share 2 cores: modelling it brings the colocated iteration (4 ranks on 2 cores) closer
    own_cores, _ = fit_efficiency_to_runs(_inputs(cores=None), runs)
    shared_error = abs(_predicted(inputs, "colocate", fitted) - measured["colocate"])
    own_error = abs(_predicted(_inputs(cores=None), "colocate", own_cores) - measured["colocate"])
    assert shared_error < own_error


def test_measured_transition_costs_come_from_the_run() -> None:
    rows = _rows("colocate")
    costs = RemapCosts.measured(rows, SETUP_SECONDS["colocate"], models=4)
    assert costs.warmup_seconds == pytest.approx(rows[0]["seconds"] - statistics.median(r["seconds"] for r in rows[1:]))
    assert costs.warmup_seconds > 0  # the first iteration of a fresh run is the slowest (warm-up measured)
    assert costs.group_creation_seconds_per_model == pytest.approx(134.6 / 4) and costs.restart_seconds == 0
    assert costs.source.startswith("measured")


def test_decision_rule_on_measured_gain_and_transition() -> None:
    gain = _measured_iteration("colocate") - _measured_iteration("standalone")
    transition = 4 * RemapCosts.measured(_rows("colocate"), SETUP_SECONDS["colocate"], models=4) \
        .group_creation_seconds_per_model
    assert gain > 0
    pays_from = int(transition // gain) + 1
    assert decide_remap(gain, pays_from - 1, transition)[0] is False
    remap, reason = decide_remap(gain, pays_from, transition)
    assert remap and "exceeds the transition" in reason
    assert decide_remap(-gain, 10**9, transition)[0] is False


def test_advisor_calibrates_from_the_runs_it_has_seen(tmp_path: Path) -> None:
    current = _run_dir(tmp_path, "colocate")
    probe = _run_dir(tmp_path, "standalone")
    costs = RemapCosts.measured(_rows("colocate"), SETUP_SECONDS["colocate"], models=4)
    alone = advise_remap(current, 1_000_000, costs=costs)
    assert "one data-parallel size" in alone.calibration
    seen = advise_remap(current, 1_000_000, costs=costs, calibration_runs=[probe])
    assert seen.drift and seen.calibration.startswith("fit_efficiency_to_runs on 2 runs")
    # calibrated on both sizes it predicts this run's iteration within 2× and finds fewer ranks per model faster
    assert 0.5 < seen.current_seconds / _measured_iteration("colocate") < 2
    assert seen.remap and seen.gain_per_iteration > 0 and seen.fragment is not None
    assert seen.transition["measured"] == 1.0 and seen.transition["warmup_seconds"] == pytest.approx(
        costs.warmup_seconds)
    few = advise_remap(current, 1, costs=costs, calibration_runs=[probe])
    assert not few.remap and "does not pay" in few.reason
    lines = [json.loads(line) for line in (current / "advisor.jsonl").read_text().splitlines()]
    assert [line["remap"] for line in lines] == [alone.remap, True, False]


def test_run_advisor_checks_every_n_steps_on_the_growing_ledger(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "colocate", rows=3)
    advisor = RunAdvisor(run_dir, every=3, total_steps=10, setup_seconds=SETUP_SECONDS["colocate"])
    assert advisor.after_step(1) is None and advisor.after_step(2) is None
    first = advisor.after_step(3)
    assert first is not None and first.step == 3 and first.remaining_iterations == 7
    shutil.copyfile(DATA / "colocate.jsonl", run_dir / "ledger.jsonl")
    assert advisor.after_step(10) is None  # the last step: nothing left to remap
    second = advisor.after_step(6)
    assert second is not None and second.remaining_iterations == 4
    assert [json.loads(x)["step"] for x in (run_dir / "advisor.jsonl").read_text().splitlines()] == [3, 6]
    summary = advisor.summary()
    assert "step 3" in summary and "step 6" in summary


def test_run_advisor_needs_a_plan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.plan"):
        RunAdvisor(tmp_path, every=2, total_steps=4)


def test_cli_calibrates_with_earlier_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hybridflow.placement.cli import main

    current, probe = _run_dir(tmp_path, "colocate"), _run_dir(tmp_path, "standalone")
    assert main(["--from-run", str(current), "--remaining", "5", "--calibrate-with", str(probe)]) == 0
    out = capsys.readouterr().out
    assert "calibration: fit_efficiency_to_runs on 2 runs" in out


def test_run_advisor_refuses_calibration_runs_it_cannot_use(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "colocate")
    with pytest.raises(ConfigError, match=r"advisor_every=0"):
        RunAdvisor(run_dir, every=0, total_steps=4, calibration_runs=[run_dir])
    with pytest.raises(ConfigError, match=r"lacks plan\.json and ledger\.jsonl"):
        RunAdvisor(run_dir, every=2, total_steps=4, calibration_runs=[tmp_path / "nowhere"])
