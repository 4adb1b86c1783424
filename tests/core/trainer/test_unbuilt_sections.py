"""Sections of roles the algorithm does not build (``critic.*`` under GRPO) are accepted — placement fragments
configure every role — but warned about, naming the keys that do nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.char_tokenizer import build_char_tokenizer
from hybridflow.config import load_config
from hybridflow.plugins import load_plugins
from hybridflow.registries import algorithms
from hybridflow.trainer.build import plan_roles

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_arithmetic_scratch.yaml"


def _plan(*overrides: str) -> None:
    load_plugins()
    config = load_config(EXAMPLE, list(overrides))
    algorithm = algorithms.get(config.algorithm.name)
    plan_roles(config, algorithm.roles(config), tokenizer=build_char_tokenizer(), algorithm=algorithm)


def test_critic_keys_under_grpo_warn_and_name_the_keys() -> None:
    with pytest.warns(UserWarning, match=r"critic\.\{optim, pool\} is set but algorithm 'grpo' builds no critic"):
        _plan("critic.pool=main", "critic.optim.lr=0.1")


def test_sections_a_built_role_reads_do_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    _plan("algorithm.name=ppo", "critic.pool=main")
    _plan()
    assert not [w for w in recwarn if "builds no" in str(w.message)]
