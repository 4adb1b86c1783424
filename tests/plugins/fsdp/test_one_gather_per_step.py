"""The hybrid engine's step on two gloo ranks at tg = 1 (the fsdp actor as one FSDP unit, the ``hf`` rollout engine
binding the handed-over weights, the worker's sequence: handover with parking, generate, sleep, end_generation, then
the update) gathers the weights once: the collectives' bytes are counted by wrapping ``torch.distributed``, per phase
and per step. The handover is FSDP's own all-gather and the update's forward reuses what it gathered; the executor's
handover (``actor.extra.handover_unshard=false``, the path before) gathers a second time in the update. Both give the
same rollouts and the same weights bit for bit, and generation holds every weight once (the FSDP shards parked)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from hybridflow.engines import OptimConfig, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
from hybridflow.testing.collectives import CollectiveCounter, gathered_bytes
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import even_split_step_inputs, sequence_mean_nll
from hybridflow.testing.fixtures import EOS_ID, PAD_ID

SAMPLING = SamplingParams(n=2, max_new_tokens=6, seed=5)
STEPS = 3


def _step_rank(rank: int, world_size: int, out_file: str) -> None:
    from hybridflow.resharding import count_storage_bytes
    from hybridflow_fsdp import handover
    from hybridflow_fsdp.rollout import HFRolloutEngine
    from hybridflow_fsdp.training import FSDPTrainingEngine

    counter = CollectiveCounter()
    spec, batch, prompts = even_split_step_inputs(rank, world_size)
    results: dict[str, Any] = {}
    for unshard in (True, False):
        actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
            model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, extra={"handover_unshard": unshard,
                                                                           "comm": "gloo"}))  # counted through gloo
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
            "weights": weights, "model_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
            "unshard_handover": actor.unshard_handover,
        }
    torch.save(results, f"{out_file}.{rank}")


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
            assert gathered_bytes(counts, "handover") == half, counts
            # the update (and a log-prob pass) reuse the gathered weights: no second all-gather in the step
            assert gathered_bytes(counts, "update") == 0 and gathered_bytes(counts, "log_probs") == 0, (step, counts)
            assert counts["update"]["reduce_scatter_single"] == (1, half), counts
            # the path before: the executor gathers in the handover, FSDP again in the update
            assert before["stats"].via == "executor" and gathered_bytes(before["counts"], "handover") == half
            again = gathered_bytes(before["counts"], "update") + gathered_bytes(before["counts"], "log_probs")
            assert again == half, before
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
