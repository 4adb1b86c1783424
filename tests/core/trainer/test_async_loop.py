"""The staleness bound of the asynchronous trainer (hybridflow.trainer.async_loop) and its config checks."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config import load_config
from hybridflow.errors import ConfigError, VersionMismatchError
from hybridflow.trainer.async_loop import STALENESS_COLUMN, enforce_staleness
from hybridflow.trainer.staleness import TOKEN_VERSIONS, oldest_token_versions, partial_rollout_metrics

POOLS = ["resource_pools.main.devices_per_node=[2]", "data.batch_size=16"]


def _rollout(versions: list[int], n: int = 2) -> Batch:
    rows = len(versions)
    batch = Batch({"responses": torch.arange(rows)[:, None], STALENESS_COLUMN: torch.tensor(versions)},
                  {"uid": [f"p{row // n}" for row in range(rows)]})
    return batch


def test_a_stale_row_drops_its_whole_prompt_group_and_is_counted() -> None:
    batch = _rollout([5, 5, 3, 5, 4, 4])  # row 2 is 3 versions behind 6: group p1 goes
    kept, dropped = enforce_staleness(batch, version=6, max_staleness=2)
    assert dropped == 2 and kept is not None
    assert kept["responses"][:, 0].tolist() == [0, 1, 4, 5] and list(kept["uid"]) == ["p0", "p0", "p2", "p2"]
    same, none_dropped = enforce_staleness(batch, version=5, max_staleness=2)
    assert same is batch and none_dropped == 0


def test_nothing_within_the_bound_is_left_returns_none() -> None:
    kept, dropped = enforce_staleness(_rollout([0, 0, 1, 1]), version=3, max_staleness=1)
    assert kept is None and dropped == 4


def test_a_rollout_newer_than_the_weights_is_an_error() -> None:
    with pytest.raises(VersionMismatchError, match="policy_version 4 reached weights of version 3"):
        enforce_staleness(_rollout([3, 4]), version=3, max_staleness=1)


def test_a_partial_rollout_row_is_as_stale_as_its_oldest_token() -> None:
    batch = _rollout([0, 0, 0, 0])
    batch[TOKEN_VERSIONS] = torch.tensor([[1, 1, 2, -1], [2, 2, 2, 2], [1, -1, -1, -1], [-1, -1, -1, -1]])
    assert oldest_token_versions(batch, fallback=7).tolist() == [1, 2, 1, 7]
    batch[STALENESS_COLUMN] = oldest_token_versions(batch, fallback=2)
    kept, dropped = enforce_staleness(batch, version=3, max_staleness=1)  # rows 0 and 2 (oldest 1) are 2 behind
    assert dropped == 4 and kept is None
    kept, dropped = enforce_staleness(batch, version=2, max_staleness=1)
    assert dropped == 0 and kept is batch
    batch[TOKEN_VERSIONS][1, 3] = 4  # one token from weights newer than the ones it would update
    with pytest.raises(VersionMismatchError, match="policy_version 4 reached weights of version 3"):
        enforce_staleness(batch, version=3, max_staleness=3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.max_staleness=1"], "rollout.pool is not set"),
    (["rollout.pool=main"], "is the actor's pool"),
    (["rollout.pool=nowhere"], "not a pool of resource_pools"),
    (["algorithm.rollout_correction=tis", "actor.recompute_log_probs=false"], "recompute_log_probs=true"),
    (["resource_pools.gen.devices_per_node=[3]", "rollout.pool=gen"], "multiple of the rollout"),
    (["rollout.weight_sync=collective"], "weight_sync = collective .* rollout.pool is not set"),
    (["rollout.weight_sync_bucket_bytes=1048576"], "weight_sync_bucket_bytes = 1048576 .* rollout.pool is not set"),
    (["resource_pools.gen.devices_per_node=[1]", "rollout.pool=gen", "rollout.weight_sync=nccl"], "weight_sync"),
    (["resource_pools.gen.devices_per_node=[1]", "rollout.pool=gen", "rollout.weight_sync_bucket_bytes=0"],
     "weight_sync_bucket_bytes"),
    (["rollout.partial_rollout=true"], "partial_rollout .* rollout.pool is not set"),
    (["rollout.partial_rollout_tokens=2"], "partial_rollout_tokens = 2 .* rollout.partial_rollout is false"),
    (["resource_pools.gen.devices_per_node=[1]", "rollout.pool=gen", "rollout.partial_rollout=true",
      "rollout.weight_sync=collective"], "rollout.weight_sync = collective broadcasts"),
    (["resource_pools.gen.devices_per_node=[1]", "rollout.pool=gen", "rollout.partial_rollout=true",
      "trainer.stream_mini_batches=true", "actor.mini_batch_size=16", "actor.recompute_log_probs=false"],
     "not combined with it"),
    (["resource_pools.gen.devices_per_node=[1]", "rollout.pool=gen", "rollout.partial_rollout=true",
      "rollout.partial_rollout_tokens=0"], "partial_rollout_tokens"),
])
def test_async_keys_are_checked_at_load(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*POOLS, *overrides])
    config = load_config(None, [*POOLS, "resource_pools.gen.devices_per_node=[1]", "rollout.pool=gen",
                                "trainer.max_staleness=2", "algorithm.rollout_correction=mis",
                                "rollout.partial_rollout=true", "rollout.partial_rollout_tokens=2"])
    assert (config.rollout.pool, config.trainer.max_staleness) == ("gen", 2)
    assert (config.rollout.partial_rollout, config.rollout.partial_rollout_tokens) == (True, 2)


def test_partial_rollout_metrics_count_mixed_rows_and_token_staleness() -> None:
    versions = torch.tensor([[2, 2, 3, -1], [3, 3, -1, -1], [2, 3, 3, 3]])  # -1: padding
    batch = Batch({TOKEN_VERSIONS: versions, STALENESS_COLUMN: torch.tensor([2, 3, 2])})
    metrics = partial_rollout_metrics(batch, step=3)
    assert metrics["async/partial_mixed_version_frac"] == pytest.approx(2 / 3)  # rows 0 and 2 span two versions
    # tokens' staleness against step 3: [1, 1, 0], [0, 0], [1, 0, 0, 0]
    assert metrics["async/token_staleness_mean"] == pytest.approx(3 / 9)
    assert metrics["async/token_staleness_max"] == 1.0
