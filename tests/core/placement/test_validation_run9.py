"""The simulator against the trainer's measured PPO iterations (issue 18's validation targets), on run 9 of
``bench/placement_validation.py`` (a quiet box, 2026-12-02, 2 seeds, 16 measured steps per placement).

``data/measured_ppo_run9_seed{0,1}/*.jsonl``: per measured step, the wall seconds of ``Trainer.train_step`` and
each node's busy seconds (and each pool's CPU seconds), for seven placements of four tiny Qwen2 models on 4 CPU
slots sharing 2 cores. Calibrated on a run's colocated and standalone placements only, the simulator must rank the
five held-out placements as measured (Spearman >= 0.9 on each run) and predict the split within 10%.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from hybridflow.placement.autoparallel import LayoutPlanner
from hybridflow.placement.calibration import fit_efficiency_to_runs
from hybridflow.placement.profiles import Efficiency
from hybridflow.placement.record import PlanInputs, PlanRecord, retime_plan
from hybridflow.testing.placement_runs import (
    CALIBRATION,
    PLACEMENTS,
    data_parallel_record,
    kendall,
    ranks,
    spearman,
    tiny_ppo_inputs,
)

DATA = Path(__file__).parent / "data"
HELD_OUT = tuple(name for name in PLACEMENTS if name not in CALIBRATION)


def _record(name: str) -> PlanRecord:
    return data_parallel_record(*PLACEMENTS[name])


def _rows(seed: int, name: str) -> list[dict]:  # type: ignore[type-arg]
    path = DATA / f"measured_ppo_run9_seed{seed}" / f"{name.replace('|', '_')}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _predicted(inputs: PlanInputs, efficiency: Efficiency, name: str) -> float:
    planner = LayoutPlanner(inputs.simulator(efficiency), inputs.dataflow, inputs.models)
    return retime_plan(planner, _record(name), inputs.cluster.device.memory_bytes * 0.9).iteration_seconds


def test_rank_statistics_average_ties() -> None:
    assert ranks([0.3, 0.1, 0.3]) == [1.5, 0.0, 1.5]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 5]) != spearman([1, 2, 3], [5, 5, 5])  # NaN: a constant side has no order
    assert kendall([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("seed", [0, 1])
def test_calibrated_on_two_placements_the_simulator_ranks_the_held_out_five_and_predicts_the_split(seed: int) -> None:
    inputs = tiny_ppo_inputs()
    fitted, _ = fit_efficiency_to_runs(inputs, [(_record(n), _rows(seed, n)) for n in CALIBRATION])
    measured = {n: statistics.median(row["seconds"] for row in _rows(seed, n)) for n in PLACEMENTS}
    predicted = {n: _predicted(inputs, fitted, n) for n in PLACEMENTS}
    held_out = spearman([measured[n] for n in HELD_OUT], [predicted[n] for n in HELD_OUT])
    assert held_out >= 0.9  # measured 0.975 on both seeds
    assert spearman(list(measured.values()), list(predicted.values())) >= 0.9  # 0.991
    # the split {actor, reference} | {critic, reward}: measured at most 1.1x the overlapped prediction (0.94, 0.82)
    assert measured["split-ar|cw"] <= 1.1 * predicted["split-ar|cw"]
    # colocated unchanged by the terms that make the split right (1.02, 1.06)
    assert 0.9 < measured["colocate"] / predicted["colocate"] < 1.1


def test_without_the_shared_cores_the_held_out_ranking_falls_apart() -> None:
    """The same fit with every slot computing on its own (``compute_units`` unset, as on GPUs): the model no longer
    sees that four slots share two cores, and ranks run 9's held-out placements wrongly."""
    own = tiny_ppo_inputs(cores=None)
    fitted, _ = fit_efficiency_to_runs(own, [(_record(n), _rows(0, n)) for n in CALIBRATION])
    measured = [statistics.median(row["seconds"] for row in _rows(0, n)) for n in HELD_OUT]
    assert spearman(measured, [_predicted(own, fitted, n) for n in HELD_OUT]) < 0.9
