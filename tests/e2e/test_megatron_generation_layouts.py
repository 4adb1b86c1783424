"""Megatron (t = 2) → generation tg = 1 and tg = 2 through the trainer: the planner's handover moves exactly the
lower bound (nothing at tg = t: megatron's tensor shards are the generation shards), at tg = 2 the rollout engine
binds views of the training parameters (the generation phase holds no byte more than training), at tg = 1 it binds
the full model with megatron's param buffer parked in it (the generation phase holds exactly M per rank, not
M/2 + M; ``weight_bytes`` in the ledger), and greedy generation at tg = 2 equals tg = 1 token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron
PRESET = "tiny-qwen2-4h"  # 4 heads / 2 KV heads: one KV group per tensor rank at t = 2


@pytest.mark.slow  # two megatron trainer runs (~70 CPU-seconds)
def test_megatron_t2_generates_at_tg1_and_tg2(tmp_path: Path, tiny_config, preset_weight_bytes) -> None:
    model_bytes, norm_bytes = preset_weight_bytes(PRESET)
    responses = {}
    for tensor in (1, 2):
        run_dir = tmp_path / f"tg{tensor}"
        trainer = Trainer(tiny_config(run_dir, "actor.engine=megatron", "actor.parallel.tensor_parallel_size=2",
                                      f"model.preset={PRESET}", f"rollout.tensor_parallel_size={tensor}",
                                      "trainer.total_steps=2", "trainer.checkpoint_every=0", "trainer.seed=0"),
                          progress=False)
        try:
            trainer.start()
            prompts = trainer.loader.peek().with_meta(iteration=0, policy_version=0)
            responses[tensor] = trainer.worker_groups().role("actor").generate(prompts, greedy=True).get(
                timeout=120)["responses"]
            history = trainer.fit()
        finally:
            trainer.close()
        assert [m["actor/policy_version"] for m in history] == [1.0, 2.0]
        for row in read_ledger(run_dir):
            edge = next(e for e in row["edges"] if e["target"] == "actor.rollout_engine")
            assert edge["protocol"] == "reshard" and edge["bytes_per_rank"] == edge["lower_bound_bytes_per_rank"]
            training, generation = row["weight_bytes"]["training"], row["weight_bytes"]["generation"]
            # training: megatron's shard, M/2 + half the replicated norms (DDP's param buffer, padded)
            assert all(model_bytes // 2 + norm_bytes // 2 <= t < model_bytes for t in training), training
            if tensor == 2:
                assert edge["bytes_per_rank"] == [0, 0], edge  # t = tg: nothing to move
                assert generation == training, (training, generation)  # every generation shard a view: no copy
            else:
                # the full model bound by the rollout engine, megatron's param buffer parked in it: exactly M
                # (without the park: M/2 + M)
                assert min(edge["bytes_per_rank"]) > 0 and generation == [model_bytes] * 2, (generation, model_bytes)
    assert torch.equal(responses[1], responses[2]), "greedy tokens at tg=2 differ from tg=1"
