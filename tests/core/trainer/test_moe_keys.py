"""The actor's MoE keys at plan time (hybridflow.trainer.build): they reach the actor's TrainingEngineConfig, and a
run whose engines cannot honour them is refused before any worker starts, naming the capability and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.algorithms.grpo import GRPO
from hybridflow.config import load_config
from hybridflow.engines import TrainingEngineConfig
from hybridflow.errors import ConfigError
from hybridflow.trainer.build import build_tokenizer, plan_roles

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_arithmetic_moe.yaml"


def _actor_engine_config(*overrides: str) -> TrainingEngineConfig:
    config = load_config(EXAMPLE, list(overrides))
    plans = plan_roles(config, GRPO().roles(config), tokenizer=build_tokenizer(config.model))
    return next(plan for plan in plans if plan.role == "actor").spec.engine_config


def test_the_keys_reach_the_actor_engine() -> None:
    engine_config = _actor_engine_config("actor.router_z_loss_coef=0.01")
    assert engine_config.router_replay == "R3"  # the example's
    assert engine_config.router_aux_loss_coef == 0.001 and engine_config.router_z_loss_coef == 0.01
    assert _actor_engine_config("actor.router_replay.mode=disabled").router_replay == "disabled"


@pytest.mark.parametrize(("overrides", "message"), [
    (("rollout.engine=vllm",), 'capability "records_routing"'),
    (("actor.engine=deepspeed",), 'capability "replays_routing"'),
    (("actor.engine=deepspeed", "actor.router_replay.mode=disabled", "actor.router_aux_loss_coef=0"),
     None),  # no MoE key in use: nothing to refuse
    (("actor.router_replay.mode=R2",), "R3"),
    (("rollout.multi_turn.enable=true",), "multi-turn and agent rollouts"),
])
def test_engines_that_cannot_honour_them_are_refused(overrides: tuple[str, ...], message: str | None) -> None:
    if message is None:
        assert _actor_engine_config(*overrides).router_replay == "disabled"
        return
    with pytest.raises(ConfigError, match=message):
        _actor_engine_config(*overrides)
