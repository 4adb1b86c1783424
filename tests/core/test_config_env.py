"""rollout.env's keys (hybridflow.config_env) are checked at load: what was expected, what was given, the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.env.url=http://127.0.0.1:1"], "expected exactly one of rollout.env.entry"),
    (["rollout.env.entry=null", "rollout.env.url=127.0.0.1:8000"], "expected an http(s):// or ws(s)://"),
    (["rollout.env.entry=tool_calc_env"], "expected 'package.module:Class'"),
    (["rollout.multi_turn.enable=true"], "rollout.env, rollout.agent and rollout.multi_turn.enable"),
    (["rollout.tensor_parallel_size=2"], "tensor_parallel_size = 1"),
])
def test_env_keys_are_checked_at_load(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(EXAMPLES / "grpo_tool_calc_env.yaml", overrides)


def test_the_example_loads_with_its_environment() -> None:
    config = load_config(EXAMPLES / "grpo_tool_calc_env.yaml")
    assert config.rollout.env is not None and config.rollout.env.entry == "hybridflow.tasks.tool_calc_env:ToolCalcEnv"
    assert config.rollout.env.tools == ["calculator"] and config.rollout.env.host == "127.0.0.1"
