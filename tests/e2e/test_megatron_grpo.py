"""GRPO with the megatron actor and the hf rollout engine: a config change only (actor.engine=megatron). The
t = 2 run is also the tensor-parallel export round trip (``hybridflow export``; tests/e2e/test_export.py: p = 2)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from export_probe import ProbedRun, check_round_trip, train_and_probe

from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed "
                       "(bash scripts/install_megatron.sh .venv)"),
]


def run(config) -> list[dict[str, float]]:
    return fit_and_close(Trainer(config, progress=False))


#: one tensor-parallel-1 megatron GRPO run, learning over LEARN_STEPS; its first 2 steps are the reference of the
#: t = 2 run (constant learning rate after warmup: a step does not depend on total_steps)
LEARN_STEPS = 30
H16 = "model.preset=tiny-qwen2-h16"  # 4 heads / 2 KV heads: one KV group per tensor rank at t = 2


@pytest.fixture(scope="module")
def tp1_history(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> list[dict[str, float]]:
    return run(tiny_config(tmp_path_factory.mktemp("tp1"), "actor.engine=megatron", H16,
                           f"trainer.total_steps={LEARN_STEPS}", "trainer.checkpoint_every=0"))


def test_grpo_with_megatron_actor_learns(tp1_history: list[dict[str, float]]) -> None:
    rewards = [m["reward/mean"] for m in tp1_history]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.02, rewards
    assert [m["actor/policy_version"] for m in tp1_history] == [float(step + 1) for step in range(LEARN_STEPS)]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> ProbedRun:  # type: ignore[no-untyped-def]
    """The t = 2 run of 2 steps, checkpointed at its end, probed and exported by the trainer."""
    run_dir, trainer_export = tmp_path_factory.mktemp("tp2"), tmp_path_factory.mktemp("tp2_trainer_export")
    history, probes = train_and_probe(
        tiny_config(run_dir, "actor.engine=megatron", H16, "actor.parallel.tensor_parallel_size=2",
                    "trainer.total_steps=2", "trainer.checkpoint_every=2"), trainer_export)
    return ProbedRun(run_dir, trainer_export, history, probes)


def test_megatron_tensor_parallel_actor_trains_through_the_mesh_protocol(
        tp2_run: ProbedRun, tp1_history: list[dict[str, float]]) -> None:
    history = tp2_run.history
    one_rank = tp1_history[:2]
    assert [m["actor/policy_version"] for m in history] == [1.0, 2.0]
    # the mesh protocol sends each tensor-parallel pair the same rows and collects one copy (16 prompts × 4 samples):
    # the same rollouts, rewards, loss and gradient norm as one rank
    assert [m["reward/mean"] for m in history] == [m["reward/mean"] for m in one_rank]
    for one, two in zip(one_rank, history):
        assert math.isfinite(two["grad_norm"]) and two["response/length_mean"] > 0
        assert math.isclose(two["grad_norm"], one["grad_norm"], rel_tol=1e-4, abs_tol=1e-7), (one, two)
        assert math.isclose(two["loss"], one["loss"], rel_tol=1e-4, abs_tol=1e-7), (one, two)
    # a step with any reward has a gradient (the first, all-zero-reward step has zero GRPO advantages)
    assert all(m["grad_norm"] > 0 for m in history if m["reward/max"] > 0) and history[-1]["reward/max"] > 0


def test_megatron_tensor_parallel_export_round_trip(tp2_run: ProbedRun, tmp_path: Path) -> None:
    """The t = 2 actor's checkpoint shards (one tensor-parallel half per rank) are reassembled offline into the HF
    model: it computes the engine's log-probs and the logits of the trainer's own export."""
    run_dir, out = tp2_run.run_dir, tmp_path / "hf"
    check_round_trip(run_dir, out, tp2_run.trainer_export, tp2_run.probes, step=2)
    assert json.loads((out / "hybridflow_export.json").read_text())["engine"] == "megatron"
    assert json.loads((run_dir / "checkpoints" / "step-2" / "actor" / "layout.json").read_text())["tp"] == 2


@pytest.mark.slow  # 45-70 s in the full run of 2026-12-07 (tests/durations.json)
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
