"""Megatron (t = 2) → generation tg = 1 and tg = 2 through the trainer: the planner's handover moves exactly the
lower bound (nothing at tg = t: megatron's tensor shards are the generation shards), at tg = 2 the rollout engine
binds views of the training parameters (the generation phase holds no byte more than training), and greedy
generation at tg = 2 equals tg = 1 token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.ledger import read_ledger
from hybridflow.trainer import Trainer

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron


@pytest.mark.slow  # two megatron trainer runs (~70 CPU-seconds)
def test_megatron_t2_generates_at_tg1_and_tg2(tmp_path: Path, tiny_config) -> None:
    responses = {}
    for tensor in (1, 2):
        run_dir = tmp_path / f"tg{tensor}"
        trainer = Trainer(tiny_config(run_dir, "actor.engine=megatron", "actor.parallel.tensor_parallel_size=2",
                                      "model.preset=tiny-qwen2-4h", f"rollout.tensor_parallel_size={tensor}",
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
            if tensor == 2:
                assert edge["bytes_per_rank"] == [0, 0], edge  # t = tg: nothing to move
                assert generation == training, (training, generation)  # every generation shard a view: no copy
            else:
                assert min(edge["bytes_per_rank"]) > 0 and all(g > t for g, t in zip(generation, training))
    assert torch.equal(responses[1], responses[2]), "greedy tokens at tg=2 differ from tg=1"
