"""The hybrid engine's step under ``mixed_precision=bf16`` on two gloo ranks at tg = 1 (the worker's sequence:
handover, generate, sleep, end_generation, update; the rollout engine at ``rollout.dtype`` bfloat16, as ``auto``
resolves it): FSDP's all-gather of bf16 weights is the handover (a quarter of the fp32 model's bytes received per
rank) and the update's forward reuses it, the lean forward runs on those bf16 weights, the gradients are
reduce-scattered in fp32, and the fp32 master weights learn. Collectives counted by wrapping ``torch.distributed``."""

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
STEPS = 4


def _step_rank(rank: int, world_size: int, out_file: str) -> None:
    from hybridflow.resharding import count_storage_bytes
    from hybridflow_fsdp import handover
    from hybridflow_fsdp.rollout import HFRolloutEngine
    from hybridflow_fsdp.training import FSDPTrainingEngine

    counter = CollectiveCounter()
    spec, batch, prompts = even_split_step_inputs(rank, world_size)
    actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, mixed_precision="bf16"))
    reference = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2))  # the same model in fp32
    rollout = HFRolloutEngine(config=RolloutEngineConfig(model=dataclasses.replace(spec, dtype="bfloat16"),
                                                         pad_token_id=PAD_ID, eos_token_id=EOS_ID))
    rollout.sleep()
    # the same starting weights: bf16 compute's log-probs against fp32's
    start_log_probs = actor.compute_log_probs(batch)["log_probs"]
    fp32_log_probs = reference.compute_log_probs(batch)["log_probs"]
    first = {name: tensor.clone() for name, tensor in actor.generation_weights()}
    steps: list[dict[str, Any]] = []
    for step in range(STEPS):
        counter.take()
        counter.phase = "handover"
        rollout.wake()
        rollout.update_weights(actor.generation_weights(park=True), version=actor.state_version(), bind=True)
        stats = actor.last_handover_stats
        counter.phase = "generate"
        generated = rollout.generate(prompts, dataclasses.replace(SAMPLING, seed=step))
        rollout_dtypes = {p.dtype for p in rollout.model.parameters()}
        generation_bytes = count_storage_bytes([*actor.model.parameters(), *rollout.model.parameters()])
        parked = handover.parked_bytes(actor)
        rollout.sleep()
        actor.end_generation()
        counter.phase = "update"
        metrics = actor.train_step(batch, loss_fn=sequence_mean_nll)
        loss = next(value for key, value in metrics.items() if key.endswith("nll"))
        steps.append({"counts": counter.take(), "stats": stats, "rollout_dtypes": rollout_dtypes,
                      "generation_bytes": generation_bytes, "parked": parked, "loss": loss,
                      "responses": generated["responses"].shape})
    full = {name: tensor.clone() for name, tensor in actor.generation_weights()}
    masters = [p.to_local().dtype for p in actor.model.parameters()]
    torch.save({"steps": steps, "lean": actor.lean is not None, "unshard": actor.unshard_handover,
                "first": first, "last": full, "masters": masters, "log_probs": start_log_probs,
                "fp32_log_probs": fp32_log_probs},
               f"{out_file}.{rank}")


def test_bf16_step_gathers_bf16_once_and_reduces_in_fp32(tmp_path: Path) -> None:
    out_file = str(tmp_path / "mp.pt")
    run_rank_groups([(_step_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=300)
    for rank in range(2):
        result = torch.load(f"{out_file}.{rank}", weights_only=False)
        # the fast path under mixed precision: the lean forward, and FSDP's own bf16 all-gather as the handover
        assert result["lean"] and result["unshard"]
        fp32_full = sum(t.numel() * 4 for t in result["last"].values())
        for step in result["steps"]:
            counts, stats = step["counts"], step["stats"]
            # the handover receives the other rank's half of the bf16 weights: a quarter of the fp32 model's bytes
            assert stats.via == "fsdp_all_gather" and stats.bytes_received == fp32_full // 4, stats
            assert gathered_bytes(counts, "handover") == fp32_full // 4, counts
            # the update reuses the gathered bf16 weights; the gradients are reduce-scattered in fp32 (half each)
            assert gathered_bytes(counts, "update") == 0, counts
            assert counts["update"]["reduce_scatter_single"] == (1, fp32_full // 2), counts
            # generation reads FSDP's gathered bf16 parameters, bound (the model's and the rollout engine's weights
            # are one set of storages: the bf16 model's bytes once, no copy of the rollout engine's own)
            assert step["rollout_dtypes"] == {torch.bfloat16}
            assert step["generation_bytes"] == fp32_full // 2, step["generation_bytes"]
            assert step["parked"] == 0  # the bf16 copy cannot hold the fp32 shard: nothing parked
        # the fp32 master weights learn: the loss falls, and the weights move by more than bf16's rounding
        losses = [step["loss"] for step in result["steps"]]
        assert losses[-1] < losses[0] - 0.05, losses
        assert set(result["masters"]) == {torch.float32}
        assert all(t.dtype == torch.float32 for t in result["last"].values())  # the executor's path: fp32 masters
        moved = max(float((result["last"][n].float() - t.float()).abs().max()) for n, t in result["first"].items())
        assert moved > 1e-2, moved
        # on the same weights bf16 compute's log-probs are fp32 tensors within bf16's rounding of fp32's, not equal
        difference = float((result["log_probs"] - result["fp32_log_probs"]).abs().max())
        assert result["log_probs"].dtype == torch.float32 and 0 < difference < 0.05, difference
