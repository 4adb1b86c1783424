"""Partial rollout through the real trainer (``rollout.partial_rollout``, docs/guide/async.md): at k = 1 the rollout
pool generates iteration s + 1 while the actor trains step s; in segments of one token, the update's weights land in the
middle of that generation and the rest of each unfinished response is sampled under them. The trained samples carry
two versions, each a version the actor had, changing only at a segment boundary and never going back, none more
than k behind the weights it updates; the run ends with finite losses and the importance weights of the per-token
rollout log-probs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hybridflow.batch import Batch
from hybridflow.trainer import Trainer
from hybridflow.trainer.async_loop import AsyncRollout
from hybridflow.trainer.staleness import STALENESS_COLUMN, TOKEN_VERSIONS

POOLS = {"main": {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": 0.25},
         "gen": {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": 0.25}}
SEGMENT = 1
STEPS = 5
PARTIAL = ("data.batch_size=4", "rollout.max_new_tokens=24", "trainer.checkpoint_every=0", "trainer.log_rollouts=0",
           f"resource_pools={yaml.safe_dump(POOLS, default_flow_style=True).strip()}", f"trainer.total_steps={STEPS}",
           "rollout.pool=gen", "trainer.max_staleness=1", "actor.recompute_log_probs=true",
           "algorithm.rollout_correction=tis", "rollout.partial_rollout=true",
           f"rollout.partial_rollout_tokens={SEGMENT}")


@pytest.mark.slow  # 35-44 s on the shared box at load average 20-23 (Ray and two pools started, 5 steps)
def test_partial_rollout_loads_an_update_mid_generation_and_bounds_the_oldest_token(tmp_path: Path,
                                                                                     tiny_config: Any) -> None:
    trainer = Trainer(tiny_config(tmp_path / "partial", *PARTIAL), progress=False)
    claimed: list[Batch] = []
    try:
        trainer.start()
        source = trainer.rollout_source
        assert isinstance(source, AsyncRollout)
        claim = source.claim

        def record(prompts: Batch) -> Batch:  # the rollout each step trains on, as handed to the algorithm
            batch = claim(prompts)
            claimed.append(batch)
            return batch

        source.claim = record  # type: ignore[method-assign]
        rows = [trainer.supervisor.run_iteration() for _ in range(STEPS)]
    finally:
        trainer.close()

    assert len(claimed) == STEPS
    actor_versions = {0} | {int(row["actor/policy_version"]) for row in rows}  # every version the actor had
    mixed = 0
    for step, batch in enumerate(claimed):
        versions, mask = batch[TOKEN_VERSIONS], batch["response_mask"].bool()
        assert ((versions >= 0) == mask).all(), step  # a version on every sampled token, on no padding
        for row in range(len(batch)):
            seen = versions[row][mask[row]].tolist()
            assert set(seen) <= actor_versions and max(seen) <= step, (step, row, seen)
            assert seen == sorted(seen), (step, row, seen)  # never back to older weights
            changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
            assert all(i % SEGMENT == 0 for i in changes), (step, row, seen)  # only between two segments
            assert step - min(seen) <= 1, (step, row, seen)  # the oldest token within the bound (k = 1)
            assert int(batch[STALENESS_COLUMN][row]) == min(seen)
            mixed += len(set(seen)) > 1
    mixed_per_step = [row["async/partial_mixed_version_frac"] for row in rows]
    assert mixed > 0, f"no trained sample was generated across a weight update (per step: {mixed_per_step})"
    assert sum(row["async/weight_sync_in_flight"] for row in rows) >= 1
    assert sum(mixed_per_step) > 0
    for step, row in enumerate(rows):
        assert all(math.isfinite(value) for key, value in row.items() if key.startswith("actor/")), step
        assert row["async/staleness_max"] <= 1 and row["async/token_staleness_max"] <= 1
    assert "actor/rollout_is_weight_mean" in rows[1]  # tis weighs each token by its own rollout log-prob
    assert all(torch.isfinite(batch["rollout_log_probs"]).all() for batch in claimed)
