"""The hybrid engine's step under ``mixed_precision=bf16`` on two gloo ranks at tg = 1 (the worker's sequence:
handover, generate, sleep, end_generation, update; the rollout engine at ``rollout.dtype`` bfloat16, as ``auto``
resolves it): FSDP's all-gather of bf16 weights is the handover (a quarter of the fp32 model's bytes received per
rank) and the update's forward reuses it, the lean forward runs on those bf16 weights, the gradients are
reduce-scattered in bf16 on CPU (``extra.reduce_dtype: auto``; ``float32`` on request: the same learning within bf16's
rounding), and the fp32 master weights learn. Collectives counted by wrapping ``torch.distributed``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
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
    # FSDP's collectives through gloo (what this counts; on one host they go through shared memory by default,
    # test_shm_comm.py)
    actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, mixed_precision="bf16", extra={"comm": "gloo"}))
    reference = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, extra={"comm": "gloo"}))  # the model in fp32
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


def test_bf16_step_gathers_bf16_once_and_reduces_in_bf16_on_cpu(tmp_path: Path) -> None:
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
            # the update reuses the gathered bf16 weights; the gradients are reduce-scattered in bf16 (auto on CPU)
            assert gathered_bytes(counts, "update") == 0, counts
            assert counts["update"]["reduce_scatter_single"] == (1, fp32_full // 4), counts
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


def _reduce_rank(rank: int, world_size: int, out_file: str) -> None:
    from hybridflow_fsdp.training import FSDPTrainingEngine

    counter = CollectiveCounter()
    spec, batch, _ = even_split_step_inputs(rank, world_size)
    results: dict[str, Any] = {}
    for reduce_dtype in ("auto", "float32"):
        actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
            model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, mixed_precision="bf16",
            extra={"reduce_dtype": reduce_dtype, "comm": "gloo"}))  # counted through gloo
        counter.take()
        counter.phase = "update"
        losses = []
        for _ in range(STEPS):
            metrics = actor.train_step(batch, loss_fn=sequence_mean_nll)
            losses.append(next(value for key, value in metrics.items() if key.endswith("nll")))
        results[reduce_dtype] = {"resolved": actor.reduce_dtype, "counts": counter.take(), "losses": losses,
                                 "weights": {n: t.clone() for n, t in actor.generation_weights()}}
    counter.close()
    torch.save(results, f"{out_file}.{rank}")


def test_the_bf16_reduction_learns_as_the_fp32_one_with_half_the_bytes(tmp_path: Path) -> None:
    out_file = str(tmp_path / "reduce.pt")
    run_rank_groups([(_reduce_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=300)
    result = torch.load(f"{out_file}.0", weights_only=False)
    auto, fp32 = result["auto"], result["float32"]
    assert (auto["resolved"], fp32["resolved"]) == ("bfloat16", "float32")
    count, nbytes = auto["counts"]["update"]["reduce_scatter_single"]
    fp32_count, fp32_bytes = fp32["counts"]["update"]["reduce_scatter_single"]
    assert count == fp32_count == STEPS and 2 * nbytes == fp32_bytes, (auto["counts"], fp32["counts"])
    # the same learning within bf16's rounding: both losses fall, step by step within 1%, and the weights differ
    # (the reduction dtype reached the update) by at most a few AdamW steps of the smallest gradients
    assert auto["losses"][-1] < auto["losses"][0] - 0.05, auto["losses"]
    for a, b in zip(auto["losses"], fp32["losses"]):
        assert abs(a - b) <= 0.01 * abs(b), (auto["losses"], fp32["losses"])
    difference = max(float((auto["weights"][n].float() - t.float()).abs().max()) for n, t in fp32["weights"].items())
    assert 0 < difference <= STEPS * 1e-2 * 2, difference


def test_reduce_dtype_is_checked() -> None:
    from hybridflow.errors import ConfigError
    from hybridflow_fsdp.training import resolve_reduce_dtype

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_reduce_dtype("auto", role="actor", mixed_precision="bf16", device=cpu) == "bfloat16"
    assert resolve_reduce_dtype("auto", role="actor", mixed_precision="bf16", device=gpu) == "float32"
    assert resolve_reduce_dtype("auto", role="actor", mixed_precision="none", device=cpu) == "float32"
    assert resolve_reduce_dtype("float32", role="actor", mixed_precision="bf16", device=cpu) == "float32"
    with pytest.raises(ConfigError, match=r"critic\.extra\.reduce_dtype must be one of .*bfloat16.*got 'fp16'"):
        resolve_reduce_dtype("fp16", role="critic", mixed_precision="bf16", device=cpu)
