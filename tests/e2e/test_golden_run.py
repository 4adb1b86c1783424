"""A refactor changes no number: the short seeded GRPO job of scripts/record_golden_run.py, run on the current code,
gives every computed metric of tests/data/golden_grpo_scratch.json bit for bit (a metric added since is allowed; one
lost or changed fails). The file was recorded on the tree before the round's refactors (the rollout-source
interface, the GRPO driver's shape, the plugin-contract records) and checked equal after them; re-record it with the
script only for a change meant to change the numbers.

Bit for bit holds on the CPU the file was recorded on (its ``machine``: model and vector ISA): on another one MKL and
oneDNN pick other kernels and blockings, and the same code gives other last bits (an AMX box read step 0's entropy
3.7747957706 for the recorded 3.7747956514, ppo_kl 8e-9 for 5e-10). There every metric must agree to
:data:`REL_TOL` / :data:`ABS_TOL` instead, still far inside what a change of the math moves, and the fresh and the
parked runs must still equal each other bit for bit."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden_grpo_scratch.json"
#: off the recording CPU: the agreement asked of every metric (a wrong sign, clip or aggregation moves them by far more)
REL_TOL, ABS_TOL = 1e-4, 1e-6


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("record_golden_run", ROOT / "scripts" / "record_golden_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_golden(rows: list[dict[str, float]], golden: list[dict[str, float]], run: str, *, exact: bool) -> None:
    assert len(rows) == len(golden) == 3
    for step, (want, got) in enumerate(zip(golden, rows)):
        missing = sorted(set(want) - set(got))
        assert not missing, f"{run}, step {step}: metrics the recorded run had are gone: {missing}"
        changed = {key: (value, got[key]) for key, value in want.items()
                   if (got[key] != value if exact else not math.isclose(got[key], value, rel_tol=REL_TOL,
                                                                        abs_tol=ABS_TOL))}
        how = "bit for bit (the recording CPU)" if exact else f"within rel {REL_TOL} / abs {ABS_TOL} (another CPU)"
        assert not changed, f"{run}, step {step}: (recorded, now) differ, compared {how}: {changed}"


@pytest.mark.slow
def test_the_seeded_job_gives_the_recorded_metrics_bit_for_bit_on_fresh_and_on_parked_processes(
        tmp_path: Path) -> None:
    """The job twice in one driver (``hybridflow train`` in a loop): the first run starts its worker processes, the
    second runs on the ones the first parked (hybridflow.controller.park: the same pids) and both give the recorded
    metrics bit for bit, so a reused process carries nothing of the earlier run into the numbers."""
    recorded = json.loads(GOLDEN.read_text())
    script = _script()
    exact = recorded.get("machine") == script.machine()
    first, second = tmp_path / "first", tmp_path / "second"
    fresh, parked = script.run_jobs_in_one_driver([first, second])
    _assert_golden(fresh, recorded["rows"], "fresh processes", exact=exact)
    assert parked == fresh  # the same CPU: a reused process gives the fresh one's numbers bit for bit
    pids = script.worker_pids(first)
    assert len(pids) == 2 and script.worker_pids(second) == pids


def test_measured_metrics_are_left_out_and_computed_ones_kept() -> None:
    computed = _script().computed({"time/step_s": 1.0, "timing_s/gen": 2.0, "throughput/x": 3.0, "perf/mfu": 0.1,
                                   "actor/pg_loss": 0.5, "reward/mean": 0.25, "process/rss": 9.0})
    assert computed == {"actor/pg_loss": 0.5, "reward/mean": 0.25}
