"""Config: YAML + dotted overrides, errors that name the key path, and `hybridflow train` without tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config import apply_overrides, config_hash, load_config
from hybridflow.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic.yaml"


def test_example_loads_and_overrides_apply() -> None:
    config = load_config(EXAMPLE, ["actor.optim.lr=1e-4", "rollout.engine=vllm",
                                   "resource_pools.main.devices_per_node=[4]"])
    assert config.actor.optim.lr == 1e-4
    assert config.rollout.engine == "vllm"
    assert config.resource_pools["main"].world_size == 4
    assert config_hash(config) != config_hash(load_config(EXAMPLE))


@pytest.mark.parametrize("override, key, expected", [
    ("actor.optim.lr=abc", "actor.optim.lr", "valid number"),
    ("actor.optim.lr=-1", "actor.optim.lr", "greater than 0"),
    ("rollout.top_p=2", "rollout.top_p", "less than or equal to 1"),
    ("actr.lr=1", "actr", "unknown key"),
    ("rollout.temprature=0.5", "rollout.temprature", "unknown key"),
    ("actor.pool=gpu", "actor.pool", "not one of resource_pools"),
    ("actor.parallel.tensor_parallel_size=3", "actor.parallel", "does not divide"),
    ("data.batch_size=3", "data.batch_size", "multiple of the actor's data-parallel size"),
])
def test_errors_name_the_key_and_the_problem(override: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [override])
    assert key in str(info.value) and expected in str(info.value)


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match=r"dotted\.key=value"):
        apply_overrides({}, ["actor.optim.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)


def test_cli_reports_bad_config_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(EXAMPLE), "rollout.n=0",
         f"trainer.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "rollout.n" in result.stderr and "greater than 0" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_unknown_engine_suggests_nearest(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(EXAMPLE), "rollout.engine=vlm",
         f"trainer.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert 'rollout.engine: Unknown rollout engine "vlm"' in result.stderr and 'Did you mean "vllm"?' in result.stderr
    assert "Traceback" not in result.stderr
