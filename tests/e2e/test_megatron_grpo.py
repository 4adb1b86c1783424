"""GRPO with the megatron actor and the hf rollout engine: a config change only (actor.engine=megatron)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed "
                       "(bash scripts/install_megatron.sh .venv)"),
]


def run(config) -> list[dict[str, float]]:
    return fit_and_close(Trainer(config, progress=False))


def test_grpo_with_megatron_actor_learns(tmp_path: Path, tiny_config) -> None:
    history = run(tiny_config(tmp_path / "m", "actor.engine=megatron", "trainer.total_steps=30",
                              "trainer.checkpoint_every=0"))
    rewards = [m["reward/mean"] for m in history]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.02, rewards
    assert history[-1]["actor/policy_version"] == 30.0


def test_megatron_tensor_parallel_actor_trains_through_the_mesh_protocol(tmp_path: Path, tiny_config) -> None:
    runs = {tp: run(tiny_config(tmp_path / f"tp{tp}", "actor.engine=megatron", "model.preset=tiny-qwen2-h16",
                                f"actor.parallel.tensor_parallel_size={tp}", "trainer.total_steps=2",
                                "trainer.checkpoint_every=0"))
            for tp in (1, 2)}
    history = runs[2]
    assert [m["actor/policy_version"] for m in history] == [1.0, 2.0]
    # the mesh protocol sends each tensor-parallel pair the same rows and collects one copy (16 prompts × 4 samples):
    # the same rollouts, rewards, loss and gradient norm as one rank
    assert [m["reward/mean"] for m in history] == [m["reward/mean"] for m in runs[1]]
    for one, two in zip(runs[1], history):
        assert math.isfinite(two["grad_norm"]) and two["response/length_mean"] > 0
        assert math.isclose(two["grad_norm"], one["grad_norm"], rel_tol=1e-4, abs_tol=1e-7), (one, two)
        assert math.isclose(two["loss"], one["loss"], rel_tol=1e-4, abs_tol=1e-7), (one, two)
    # a step with any reward has a gradient (the first, all-zero-reward step has zero GRPO advantages)
    assert all(m["grad_norm"] > 0 for m in history if m["reward/max"] > 0) and history[-1]["reward/max"] > 0


def test_ppo_with_megatron_actor_critic_reference_checkpoints_and_resumes(tmp_path: Path, tiny_config) -> None:
    overrides = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "actor.engine=megatron", "critic.engine=megatron",
                 "reference.engine=megatron", "trainer.checkpoint_every=1")
    first = run(tiny_config(tmp_path / "ppo", *overrides, "trainer.total_steps=2"))
    assert [m["actor/policy_version"] for m in first] == [1.0, 2.0]
    # the megatron critic was trained (a value loss each step) and the megatron reference scored the KL
    assert all(math.isfinite(m["critic/vf_loss"]) and m["critic/vf_loss"] > 0 for m in first)
    assert first[0]["kl/actor_ref"] < 1e-6 < first[-1]["kl/actor_ref"]  # equal to the actor until its first update
    resumed = run(tiny_config(tmp_path / "ppo", *overrides, "trainer.total_steps=3", "trainer.resume=must"))
    assert [m["actor/policy_version"] for m in resumed] == [3.0]  # actor, critic and reference state reloaded
