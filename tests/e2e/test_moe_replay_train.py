"""Rollout routing replay (R3) on the trainer's path: GRPO on a tiny Qwen3-MoE (examples/grpo_arithmetic_moe.yaml:
4 experts, top-2, 2 MoE layers) over 2 FSDP workers, the hf rollout generating in bf16 while the actor trains in
fp32 (the perturbation that makes routers flip between rollout and training; in fp32 on both sides they agree on
this model). With ``actor.router_replay.mode=R3`` the recorded ``routed_experts`` column travels with the batch to
each worker's shard and the actor's forwards (π_old and the update) route exactly as the rollout did: zero flips,
and a rollout/actor probability gap no larger than without replay, where the flips are measured (> 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridflow.config import load_config
from hybridflow.trainer import Trainer

#: two trainer runs of 2 steps each on 2 FSDP workers: ~115 s on the loaded 2-core box (module-scoped, one per mode)
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_moe.yaml"
STEPS = 2


def run(mode: str, run_dir: Path) -> list[dict[str, Any]]:
    config = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
                                   "trainer.resume=never", "trainer.val_every=0", "trainer.val_n=1",
                                   "data.task.num_val_prompts=0", f"trainer.total_steps={STEPS}",
                                   "trainer.checkpoint_every=0", f"actor.router_replay.mode={mode}"])
    trainer = Trainer(config, progress=False)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == STEPS
    return history


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The example's run with replay on (R3) and off, same seed: the same first rollout from the same weights."""
    return {mode: run(mode, tmp_path_factory.mktemp(f"moe_{mode}") / "run") for mode in ("R3", "disabled")}


def test_replay_leaves_no_routing_flip_between_rollout_and_training(
        moe_runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every step reports the MoE metrics; with R3 no recorded response token is routed differently in training
    (while the training router on its own would have flipped some: the replay did the work), without it some are."""
    for mode, history in moe_runs.items():
        for step in history:
            for key in ("actor/router_flip_ratio", "actor/router_flip_ratio_own", "actor/moe/load_balancing_loss",
                        "actor/moe/load_imbalance", "training/rollout_probs_diff_mean"):
                assert key in step, (mode, key, sorted(step))
    replayed, unreplayed = moe_runs["R3"], moe_runs["disabled"]
    assert [step["actor/router_flip_ratio"] for step in replayed] == [0.0] * STEPS, replayed
    assert max(step["actor/router_flip_ratio_own"] for step in replayed) > 0, replayed
    flips = [step["actor/router_flip_ratio"] for step in unreplayed]
    assert min(flips) > 0, flips
    assert flips == [step["actor/router_flip_ratio_own"] for step in unreplayed]


def test_replay_gap_is_at_most_the_unreplayed_gap(moe_runs: dict[str, list[dict[str, Any]]]) -> None:
    """π_rollout against π_old (the actor's recomputed log-probs) at the first step, where both runs generated the
    same rollout from the same weights: replaying the routing narrows the gap (strictly: the flipped tokens of that
    rollout are scored through the rollout's experts; a π_old pass that routed afresh would give the same gap)."""
    gaps = {mode: history[0]["training/rollout_probs_diff_mean"] for mode, history in moe_runs.items()}
    assert gaps["R3"] < gaps["disabled"], gaps
