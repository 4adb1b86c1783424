"""Every shipped example config loads (schema and cross-field checks), and the asynchronous main job is the
configuration docs/guide/async.md measured: split pools, one step of staleness, the decoupled PPO objective."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.rm_config import load_rm_config
from hybridflow.trainer.sft_config import load_sft_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_example_config_loads(path: Path) -> None:
    loader = {"sft": load_sft_config, "rm": load_rm_config}.get(path.name.split("_")[0], load_config)
    config = loader(path, [])
    assert config.trainer.run_dir


def test_async_main_job_is_the_measured_configuration() -> None:
    synchronous = load_config(EXAMPLES / "grpo_arithmetic.yaml", [])
    config = load_config(EXAMPLES / "grpo_arithmetic_async.yaml", [])
    assert config.rollout.pool == "gen" and config.actor.pool == "main"
    assert set(config.resource_pools) == {"main", "gen"}
    assert config.trainer.max_staleness == 1
    assert config.actor.recompute_log_probs and config.algorithm.rollout_correction == "tis"
    # everything else is the synchronous main job's, so the comparison in docs/guide/async.md holds
    assert config.model.path == synchronous.model.path
    assert config.rollout.n == synchronous.rollout.n and config.data.batch_size == synchronous.data.batch_size
    assert config.actor.optim == synchronous.actor.optim
    assert config.actor.entropy_target == synchronous.actor.entropy_target
