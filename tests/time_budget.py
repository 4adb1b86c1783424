"""The suite's time report and budget: what each test costs, kept in the repository, and a check that fails the run
when a test over its budget arrives unmarked.

``tests/durations.json`` is the per-test time report of the last full run recorded on the 2-core box (written by a run
with ``HYBRIDFLOW_TEST_TIMES_OUT=tests/durations.json``): each test's wall seconds (setup + call + teardown, so the
test that pays a module fixture carries it) and each module's sum. ``tests/conftest.py`` uses the module sums to hand
the longest modules to the two workers first.

With ``HYBRIDFLOW_TEST_BUDGET=1`` (set by ``scripts/test.sh``) the run fails at its end, listing each offender and the
fix, when

- a test not marked ``slow`` took more than :data:`UNMARKED_BUDGET_S`: mark it ``@pytest.mark.slow`` (the suite still
  runs it; the mark puts its module first and records that it is paid for on purpose) or make it cheaper;
- a ``slow`` test took more than :data:`SLOW_FACTOR` times its recorded time (and over :data:`SLOW_FLOOR_S`), or over
  :data:`NEW_SLOW_BUDGET_S` when it has no recorded time yet: a test that grew that much is a regression to look at,
  and a new slow test gets recorded by the next full run.

Budgets are wall seconds on purpose (a test's Ray workers and subprocesses are part of its cost), with margins wide
enough for the load two xdist workers put on two cores.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPORT = Path(__file__).with_name("durations.json")
BUDGET_VARIABLE = "HYBRIDFLOW_TEST_BUDGET"
TIMES_OUT_VARIABLE = "HYBRIDFLOW_TEST_TIMES_OUT"
#: an unmarked test over this many wall seconds fails a budgeted run
UNMARKED_BUDGET_S = 60.0
#: a slow test fails a budgeted run over this factor of its recorded time ...
SLOW_FACTOR = 3.0
#: ... unless it stays under this many seconds
SLOW_FLOOR_S = 120.0
#: a slow test with no recorded time yet fails a budgeted run over this many seconds
NEW_SLOW_BUDGET_S = 300.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_report(path: Path = REPORT) -> dict[str, float]:
    """The recorded per-test seconds ({} when there is no report yet)."""
    if not path.exists():
        return {}
    tests = json.loads(path.read_text()).get("tests", {})
    return {str(nodeid): float(seconds) for nodeid, seconds in tests.items()}


def module_seconds(tests: dict[str, float]) -> dict[str, float]:
    modules: dict[str, float] = {}
    for nodeid, seconds in tests.items():
        modules[module_of(nodeid)] = modules.get(module_of(nodeid), 0.0) + seconds
    return modules


@dataclass
class Offender:
    nodeid: str
    seconds: float
    budget: float
    why: str

    def line(self) -> str:
        return f"{self.nodeid}: {self.seconds:.1f} s against a budget of {self.budget:.0f} s ({self.why})"


def offenders(times: dict[str, float], slow: set[str], recorded: dict[str, float]) -> list[Offender]:
    """The tests of one run over their budgets (see the module's docstring for the rules)."""
    found = []
    for nodeid, seconds in sorted(times.items()):
        if nodeid not in slow:
            if seconds > UNMARKED_BUDGET_S:
                found.append(Offender(nodeid, seconds, UNMARKED_BUDGET_S,
                                      "unmarked: mark it @pytest.mark.slow or make it cheaper"))
        elif nodeid in recorded:
            budget = max(SLOW_FLOOR_S, SLOW_FACTOR * recorded[nodeid])
            if seconds > budget:
                found.append(Offender(nodeid, seconds, budget,
                                      f"{SLOW_FACTOR:g}x its recorded {recorded[nodeid]:.1f} s: find what grew"))
        elif seconds > NEW_SLOW_BUDGET_S:
            found.append(Offender(nodeid, seconds, NEW_SLOW_BUDGET_S, "a new slow test: make it cheaper"))
    return found


@dataclass(eq=False)  # pluggy keeps registered plugins in sets
class TimeBudget:
    """Sums each test's phases as their reports arrive (on the xdist controller too) and judges them at the end."""

    enforce: bool
    times_out: Path | None
    recorded: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)
    slow: set[str] = field(default_factory=set)
    failed: list[Offender] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.times[report.nodeid] = self.times.get(report.nodeid, 0.0) + report.duration
        if "slow" in report.keywords:
            self.slow.add(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: its controller judges the whole run
            return
        if self.times_out is not None and self.times:
            self.write(self.times_out)
        if self.enforce:
            self.failed = offenders(self.times, self.slow, self.recorded)
            if self.failed and session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.times:
            return
        wall = time.monotonic() - self.started
        summed = sum(self.times.values())
        terminalreporter.section("test time budget")
        terminalreporter.write_line(
            f"{len(self.times)} tests, {summed:.0f} test-seconds in {wall:.0f} s of wall time "
            f"(recorded full run: {sum(self.recorded.values()):.0f} test-seconds)")
        for module, seconds in sorted(module_seconds(self.times).items(), key=lambda kv: -kv[1])[:10]:
            terminalreporter.write_line(f"  {seconds:7.1f} s  {module}")
        for offender in self.failed:
            terminalreporter.write_line(f"OVER BUDGET {offender.line()}", red=True)
        if self.failed:
            terminalreporter.write_line(
                f"{len(self.failed)} test(s) over budget (tests/time_budget.py; {BUDGET_VARIABLE}=1 checks it)",
                red=True)

    def write(self, path: Path) -> None:
        document = {
            "recorded": {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "command": f"{TIMES_OUT_VARIABLE}={path} bash scripts/test.sh",
                "wall_s": round(time.monotonic() - self.started, 1),
            },
            "modules": {module: round(seconds, 2) for module, seconds in
                        sorted(module_seconds(self.times).items(), key=lambda kv: -kv[1])},
            "tests": {nodeid: round(seconds, 2) for nodeid, seconds in sorted(self.times.items())},
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(document, indent=1) + "\n")
        tmp.replace(path)


def plugin_from_environment() -> TimeBudget:
    out = os.environ.get(TIMES_OUT_VARIABLE)
    return TimeBudget(enforce=os.environ.get(BUDGET_VARIABLE) == "1",
                      times_out=Path(out) if out else None, recorded=load_report())
