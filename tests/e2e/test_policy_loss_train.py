"""The policy-loss keys through the trainer: a one-step GRPO run per loss, configured by the config's keys only,
whose actor worker reports the loss it computed (docs/guide/algorithms.md, "Policy losses")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridflow.trainer import Trainer

#: one step on one worker; two epochs, so the second one's ratios are off-policy (the clips have something to clip)
COMMON = ("trainer.total_steps=1", "trainer.checkpoint_every=0", "resource_pools.main.devices_per_node=[1]",
          "actor.ppo_epochs=2")
MODES = {
    "gspo": ("actor.loss_mode=gspo", "actor.loss_agg=seq-mean-token-mean", "actor.clip_ratio_low=3e-4",
             "actor.clip_ratio_high=4e-4"),
    "cispo": ("actor.loss_mode=cispo", "actor.clip_ratio_low=1.0", "actor.clip_ratio_high=0.28"),
    # c just above 1: a negative-advantage token whose ratio grew past it in the first epoch is dual-clipped
    "dual-clip": ("actor.clip_ratio_c=1.001",),
}
#: the metric only that loss reports: GSPO's sequence ratio, CISPO's clipped weight
OWN_METRIC = {"gspo": "actor/seq_ratio_mean", "cispo": "actor/clipped_ratio_mean"}


@pytest.fixture(scope="module", params=list(MODES))
def mode_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             tiny_config: Any) -> tuple[str, dict[str, float]]:
    mode: str = request.param
    run_dir: Path = tmp_path_factory.mktemp(mode) / "run"
    trainer = Trainer(tiny_config(run_dir, *COMMON, *MODES[mode]), progress=False)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == 1
    return mode, history[0]


def test_the_actor_computes_the_configured_policy_loss(mode_run: tuple[str, dict[str, float]]) -> None:
    """Each run's actor metrics name its loss: GSPO and CISPO their own metric (and not the other's), the dual clip
    a non-zero ``actor/pg_clipfrac_lower`` (which no other loss can report). A build that dropped actor.loss_mode or
    actor.clip_ratio_c would run vanilla PPO without the dual clip and fail here."""
    mode, metrics = mode_run
    actor = {key: value for key, value in metrics.items() if key.startswith("actor/")}
    assert actor["actor/ratio_mean"] != 1.0, actor  # the second epoch ran off-policy: there was something to clip
    for other, key in OWN_METRIC.items():
        assert (key in actor) == (other == mode), (mode, actor)
    if mode == "dual-clip":
        assert actor["actor/pg_clipfrac_lower"] > 0, actor
    else:
        assert actor["actor/pg_clipfrac_lower"] == 0.0, actor
    if mode == "gspo":
        assert actor["actor/seq_ratio_mean"] != 1.0, actor
    if mode == "cispo":
        assert 0 < actor["actor/clipped_ratio_mean"] <= 1.28, actor  # the weight is clipped at 1 + clip_ratio_high
