"""``rollout.weight_sync: collective`` through the real trainer (docs/async.md): at trainer.max_staleness = 1 the
weights broadcast over the gloo group between the actor's rank 0 and the rollout pool give the same run, metric for
metric and weight for weight, as the object-store sync, with every sync's bytes counted in bounded buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from export_probe import fit_and_export

POOLS = {"main": {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": 0.25},
         "gen": {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": 0.25}}
BUCKET_BYTES = 64 << 10  # several buckets for the scratch model
RUN = ("data.batch_size=4", "rollout.max_new_tokens=6", "trainer.checkpoint_every=0", "trainer.log_rollouts=0",
       f"resource_pools={yaml.safe_dump(POOLS, default_flow_style=True).strip()}", "trainer.total_steps=3",
       "rollout.pool=gen", "trainer.max_staleness=1", f"rollout.weight_sync_bucket_bytes={BUCKET_BYTES}")
UNCOMPARED = ("time/", "throughput/", "async/")  # timings, and the sync's own counters (compared below)


@pytest.mark.slow
def test_collective_sync_trains_as_the_object_store_sync_does(tmp_path: Path, tiny_config: Any,
                                                              preset_weight_bytes: Any) -> None:
    stored, stored_weights = fit_and_export(tiny_config(tmp_path / "store", *RUN), tmp_path / "hf-store")
    config = tiny_config(tmp_path / "collective", *RUN, "rollout.weight_sync=collective")
    collective, collective_weights = fit_and_export(config, tmp_path / "hf-collective")
    assert len(stored) == len(collective) == 3
    for step, (expected, got) in enumerate(zip(stored, collective)):
        compared = {key: value for key, value in expected.items() if not key.startswith(UNCOMPARED)}
        assert {key: got[key] for key in compared} == compared, f"step {step}"
        # the same syncs, byte for byte: all the weights (M) once per sync, in buckets of at most the bound
        for key in ("async/weight_sync_bytes", "async/weight_sync_buckets", "async/weight_sync_peak_bucket_bytes"):
            assert got[key] == expected[key], (step, key)
        assert got["async/weight_sync_peak_bucket_bytes"] <= BUCKET_BYTES
    # syncs checked at steps 0 (version 0) and 2 (version 1, behind iteration 2's rollout); at k = 1 step 1's
    # rollout was generated under version 0, behind no new sync
    assert [row["async/weight_sync_bytes"] > 0 for row in collective] == [True, False, True]
    total, _ = preset_weight_bytes(config.model.preset)  # every weight crossed (a tied one may cross twice)
    assert collective[0]["async/weight_sync_bytes"] >= total and collective[0]["async/weight_sync_buckets"] > 1
    assert collective[1]["async/staleness_max"] == 1  # generated under version 0 while step 0 trained
    assert collective_weights.keys() == stored_weights.keys()
    for name, tensor in stored_weights.items():
        assert torch.equal(collective_weights[name], tensor), name
