"""The hybrid engine's step on two gloo ranks at tg = 1 (the fsdp actor as one FSDP unit, the ``hf`` rollout engine
binding the handed-over weights, the worker's sequence: handover with parking, generate, sleep, end_generation, then
the update) gathers the weights once: the collectives' bytes are counted by wrapping ``torch.distributed``, per phase
and per step. The handover is FSDP's own all-gather and the update's forward reuses what it gathered; the executor's
handover (``actor.extra.handover_unshard=false``, the path before) gathers a second time in the update. Both give the
same rollouts and the same weights bit for bit, and generation holds every weight once (the FSDP shards parked)."""

from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridflow.engines import ModelSpec, OptimConfig, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
from hybridflow.testing.contracts.rollout import build_prompt_batch
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow.testing.fixtures import EOS_ID, PAD_ID, tiny_model_config

SAMPLING = SamplingParams(n=2, max_new_tokens=6, seed=5)
STEPS = 3


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _received_bytes(name: str, args: list[Any]) -> int:
    """Bytes this rank receives in one call of collective ``name`` (positional arguments in signature order; 2 ranks:
    all-gather = output − input, reduce-scatter = input − output, all-reduce = the tensor, point-to-point = the irecv
    buffers)."""
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return _nbytes(args[0]) - _nbytes(args[1])
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return _nbytes(args[1]) - _nbytes(args[0])
    if name == "all_gather":
        return sum(_nbytes(t) for t in args[0]) - _nbytes(args[1])
    if name in ("all_reduce", "broadcast"):
        return _nbytes(args[0])
    if name == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in args[0] if op.op.__name__ == "irecv")
    return 0  # all_gather_object: pickled Python values (a row count), counted by calls only


class CollectiveCounter:
    """Wraps the ``torch.distributed`` functions FSDP2, the reshard executor and the engine call; ``phase`` labels
    what is counted (calls and received bytes per collective name), nested calls (all_gather_object's all_gather)
    count once."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_gather", "all_reduce", "broadcast", "batch_isend_irecv", "all_gather_object")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.phase = "other"
        self.counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self._depth = 0
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(function)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                entry = self.counts[self.phase][name]
                entry[0] += 1
                entry[1] += _received_bytes(name, list(signature.bind(*args, **kwargs).arguments.values()))
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def take(self) -> dict[str, dict[str, tuple[int, int]]]:
        out = {phase: {name: (c[0], c[1]) for name, c in names.items()} for phase, names in self.counts.items()}
        self.counts.clear()
        return out


def _step_rank(rank: int, world_size: int, out_file: str) -> None:
    from hybridflow.resharding import count_storage_bytes
    from hybridflow_fsdp import handover
    from hybridflow_fsdp.rollout import HFRolloutEngine
    from hybridflow_fsdp.training import FSDPTrainingEngine

    counter = CollectiveCounter()
    # vocabulary 48: every parameter splits evenly over 2 ranks, so FSDP moves no padding (bytes = the lower bound)
    spec = ModelSpec(config=tiny_model_config(num_heads=4, num_kv_heads=2, vocab_size=48), seed=3)
    batch = build_training_batch(rows=8).chunk(world_size)[rank]
    prompts = build_prompt_batch()
    results: dict[str, Any] = {}
    for unshard in (True, False):
        actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
            model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, extra={"handover_unshard": unshard}))
        rollout = HFRolloutEngine(config=RolloutEngineConfig(model=spec, pad_token_id=PAD_ID, eos_token_id=EOS_ID))
        rollout.sleep()
        steps, rollouts, generation_bytes, parked = [], [], [], []
        for step in range(STEPS):
            counter.take()
            counter.phase = "handover"
            rollout.wake()
            rollout.update_weights(actor.generation_weights(park=True), version=actor.state_version(), bind=True)
            stats = actor.last_handover_stats
            counter.phase = "generate"
            rollouts.append(rollout.generate(prompts, dataclasses.replace(SAMPLING, seed=step)))
            generation_bytes.append(count_storage_bytes([*actor.model.parameters(), *rollout.model.parameters()]))
            parked.append(handover.parked_bytes(actor))
            rollout.sleep()
            actor.end_generation()
            if step == STEPS - 1:  # a log-prob pass between generation and update (actor.recompute_log_probs)
                counter.phase = "log_probs"
                actor.compute_log_probs(batch)
            counter.phase = "update"
            actor.train_step(batch, loss_fn=sequence_mean_nll)
            steps.append({"counts": counter.take(), "stats": stats})
        weights = {name: tensor.clone() for name, tensor in actor.generation_weights()}
        results[f"unshard={unshard}"] = {
            "steps": steps, "rollouts": rollouts, "generation_bytes": generation_bytes, "parked": parked,
            "weights": weights, "model_bytes": sum(_nbytes(t) for t in weights.values()),
            "unshard_handover": actor.unshard_handover,
        }
    torch.save(results, f"{out_file}.{rank}")


def _gathered(counts: dict[str, dict[str, tuple[int, int]]], phase: str) -> int:
    """Bytes received by all-gathers in ``phase`` (FSDP's and the executor's)."""
    names = ("all_gather_single", "all_gather_into_tensor", "all_gather", "batch_isend_irecv")
    return sum(counts.get(phase, {}).get(name, (0, 0))[1] for name in names)


def test_two_rank_step_gathers_the_weights_once(tmp_path: Path) -> None:
    out_file = str(tmp_path / "counts.pt")
    run_rank_groups([(_step_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=300)
    for rank in range(2):
        results = torch.load(f"{out_file}.{rank}", weights_only=False)
        new, old = results["unshard=True"], results["unshard=False"]
        assert new["unshard_handover"] and not old["unshard_handover"]
        model_bytes = new["model_bytes"]
        half = model_bytes // 2
        for step, (now, before) in enumerate(zip(new["steps"], old["steps"], strict=True)):
            counts, stats = now["counts"], now["stats"]
            # the handover: FSDP's all-gather of the other rank's half, = the planner's lower bound
            assert stats.via == "fsdp_all_gather" and stats.bytes_received == stats.lower_bound_bytes == half, stats
            assert _gathered(counts, "handover") == half, counts
            # the update (and a log-prob pass) reuse the gathered weights: no second all-gather in the step
            assert _gathered(counts, "update") == 0 and _gathered(counts, "log_probs") == 0, (step, counts)
            assert counts["update"]["reduce_scatter_single"] == (1, half), counts
            # the path before: the executor gathers in the handover, FSDP again in the update
            assert before["stats"].via == "executor" and _gathered(before["counts"], "handover") == half
            assert _gathered(before["counts"], "update") + _gathered(before["counts"], "log_probs") == half, before
        # generation holds every weight once: FSDP's gathered weights, bound by the rollout engine, the shards parked
        assert new["generation_bytes"] == [model_bytes] * STEPS, (new["generation_bytes"], model_bytes)
        assert new["parked"] == [half] * STEPS, new["parked"]
        # the same weights everywhere: identical rollouts and identical weights after the updates, bit for bit
        for a, b in zip(new["rollouts"], old["rollouts"], strict=True):
            assert torch.equal(a["responses"], b["responses"])
            assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
        assert new["weights"].keys() == old["weights"].keys()
        for name, tensor in new["weights"].items():
            assert torch.equal(tensor, old["weights"][name]), name
