"""The time budget of tests/time_budget.py, through real pytest sessions on a tiny project: an unmarked test over its
budget fails a budgeted run and is named with the fix; a slow-marked one passes within its recorded budget and fails
past it; without the variable nothing is judged; the report written is what the next run schedules by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import time_budget
from time_budget import TimeBudget, load_report, module_seconds

pytest_plugins = ["pytester"]

PROJECT = """
import time

import pytest


def test_quick() -> None:
    pass


def test_long_unmarked() -> None:
    time.sleep(0.4)


@pytest.mark.slow
def test_long_marked() -> None:
    time.sleep(0.4)
"""


@pytest.fixture
def budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budgets in tenths of a second, so a 0.4 s test is over the unmarked one."""
    monkeypatch.setattr(time_budget, "UNMARKED_BUDGET_S", 0.2)
    monkeypatch.setattr(time_budget, "SLOW_FLOOR_S", 0.1)
    monkeypatch.setattr(time_budget, "NEW_SLOW_BUDGET_S", 0.3)


def _run(pytester: pytest.Pytester, budget: TimeBudget) -> pytest.RunResult:
    pytester.makeini("[pytest]\nmarkers =\n    slow: s\n")
    pytester.makepyfile(test_project=PROJECT)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[budget])


def test_an_unmarked_test_over_budget_fails_the_run_and_is_named(pytester: pytest.Pytester, budgets: None) -> None:
    recorded = {"test_project.py::test_long_marked": 0.4}
    result = _run(pytester, TimeBudget(enforce=True, times_out=None, recorded=recorded))
    result.assert_outcomes(passed=3)  # every test passed ...
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # ... and the run failed on the budget
    assert [offender.nodeid for offender in budget_offenders(result)] == ["test_project.py::test_long_unmarked"]
    result.stdout.fnmatch_lines(["OVER BUDGET test_project.py::test_long_unmarked: 0.* s against a budget of 0 s "
                                 "(unmarked: mark it @pytest.mark.slow or make it cheaper)"])


def test_a_slow_test_past_its_recorded_budget_fails(pytester: pytest.Pytester, budgets: None) -> None:
    recorded = {"test_project.py::test_long_marked": 0.01}  # it once took 10 ms: 0.4 s is > 3x and over the floor
    result = _run(pytester, TimeBudget(enforce=True, times_out=None, recorded=recorded))
    nodeids = [offender.nodeid for offender in budget_offenders(result)]
    assert nodeids == ["test_project.py::test_long_marked", "test_project.py::test_long_unmarked"]
    result.stdout.fnmatch_lines(["*test_long_marked: 0.* s*3x its recorded 0.0 s: find what grew*"])


def test_a_new_slow_test_over_the_new_budget_fails(pytester: pytest.Pytester, budgets: None) -> None:
    result = _run(pytester, TimeBudget(enforce=True, times_out=None, recorded={}))
    assert "test_project.py::test_long_marked" in [offender.nodeid for offender in budget_offenders(result)]
    result.stdout.fnmatch_lines(["*test_long_marked*a new slow test: make it cheaper*"])


def test_without_the_variable_nothing_is_judged_and_the_report_is_written(
        pytester: pytest.Pytester, budgets: None, tmp_path: Path) -> None:
    out = tmp_path / "durations.json"
    result = _run(pytester, TimeBudget(enforce=False, times_out=out, recorded={}))
    assert result.ret == pytest.ExitCode.OK
    document = json.loads(out.read_text())
    assert set(document["recorded"]) == {"date", "machine", "command", "wall_s"}
    tests = load_report(out)
    assert set(tests) == {f"test_project.py::{name}" for name in ("test_quick", "test_long_unmarked",
                                                                  "test_long_marked")}
    assert tests["test_project.py::test_long_marked"] >= 0.4 > tests["test_project.py::test_quick"]
    assert module_seconds(tests) == pytest.approx(document["modules"], abs=0.02)


def test_the_recorded_report_covers_the_suite() -> None:
    """The kept report names real test modules (a renamed module leaves a stale entry to re-record)."""
    tests = load_report()
    assert tests, "tests/durations.json is missing: record it with HYBRIDFLOW_TEST_TIMES_OUT=tests/durations.json"
    root = Path(__file__).parent.parent
    missing = sorted({module for module in module_seconds(tests) if not (root / module).exists()})
    assert len(missing) <= 0.1 * len(module_seconds(tests)), f"report names modules that are gone: {missing}"


def budget_offenders(result: pytest.RunResult) -> list[time_budget.Offender]:
    """The offenders the session's plugin judged (read back from the terminal lines it wrote)."""
    found = []
    for line in result.outlines:
        if line.startswith("OVER BUDGET "):
            nodeid, rest = line[len("OVER BUDGET "):].split(": ", 1)
            found.append(time_budget.Offender(nodeid, float(rest.split(" s ", 1)[0]), 0.0, rest))
    return found
