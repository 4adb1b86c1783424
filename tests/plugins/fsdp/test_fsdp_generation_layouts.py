"""The FSDP engine's default handover on real gloo ranks: FSDP d ranks → generation (pg = 1, tg) through the reshard
planner, for d = 2, 4 and every tg dividing d. Each rank's generation shards equal the slices of the full weights
the tensor-parallel layout names, the bytes the executor counted equal the lower bound, and at d == tg every
sharded weight is a view of the FSDP shard (resident weight bytes, counted from storages, do not grow beyond the
gathered norms). With ``park=True`` (the actor worker's path) no rank holds a weight twice at any d and tg: the
FSDP storage is released into the generation shards (resident = the generation shards only, M/tg + the norms'
other halves) and comes back bit for bit, by ``end_generation()`` or by the next forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
from hybridflow.presets import preset_model_config
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import build_training_batch


def _generation_rank(rank: int, world_size: int, tensors: list[int], workdir: str) -> None:
    from torch.distributed.tensor import DTensor

    from hybridflow.resharding import count_storage_bytes
    from hybridflow_fsdp.layouts import build_hf_rollout_layout
    from hybridflow_fsdp.training import FSDPTrainingEngine

    spec = ModelSpec(config=preset_model_config("tiny-qwen2-4h"), seed=3)
    # row weights FSDP-sharded along dim 1 (as for tg = max(tensors)); every tg is planned from the same shards
    engine = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), generation_tensor_parallel_size=max(tensors)),
        device="cpu")
    training = list(engine.model.parameters())
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in engine.model.named_parameters()}
    shapes = {name: tuple(t.shape) for name, t in full.items()}
    results = {}
    for tensor in tensors:
        shards = dict(engine.generation_weights(tensor_parallel_size=tensor))
        expected = build_hf_rollout_layout(shapes, data=world_size, tensor=tensor).extract_shards(full, rank)
        results[tensor] = {
            "stats": engine.last_handover_stats,
            "mismatched": sorted(name for name in expected if not torch.equal(expected[name], shards[name])),
            "training_bytes": count_storage_bytes(training),
            "generation_bytes": count_storage_bytes([*training, *shards.values()]),
            "model_bytes": sum(t.numel() * 4 for t in full.values()),
            "target_bytes": sum(t.numel() * 4 for t in expected.values()),
            "replicated_bytes": sum(t.numel() * 4 for name, t in full.items() if "norm" in name)}
        del shards
        results[tensor].update(_park_cycle(engine, training, expected, tensor, world_size, rank))
    torch.save(results, f"{workdir}/rank{rank}.pt")


def _park_cycle(engine, training, expected, tensor, world_size, rank):  # type: ignore[no-untyped-def]
    """Hand over with ``park=True``, count what is resident, restore (by end_generation, then by a forward)."""
    from hybridflow.resharding import count_storage_bytes

    batch = build_training_batch(rows=2 * world_size).chunk(world_size)[rank]
    before = engine.compute_log_probs(batch)["log_probs"]
    # the sharded parameters themselves: a one-unit model stays gathered after a forward (its registered parameters
    # are then the unsharded ones until the next handover, checkpoint or update reshards it)
    snapshot = [p.to_local().clone() for p in training]
    shards = dict(engine.generation_weights(tensor_parallel_size=tensor, park=True))
    stats = engine.last_handover_stats
    out = {"park_stats": stats,
           "park_mismatched": sorted(name for name in expected if not torch.equal(expected[name], shards[name])),
           "parked_training_bytes": count_storage_bytes(training),
           "parked_generation_bytes": count_storage_bytes([*training, *shards.values()]),
           "parked_target_bytes": sum(t.numel() * 4 for t in shards.values())}
    engine.end_generation()
    out["restored_equal"] = all(torch.equal(a, p.to_local()) for a, p in zip(snapshot, training, strict=True))
    out["restored_training_bytes"] = count_storage_bytes(training)
    # a forward restores by itself when end_generation() is skipped
    shards = dict(engine.generation_weights(tensor_parallel_size=tensor, park=True))
    out["forward_after_park_equal"] = torch.equal(engine.compute_log_probs(batch)["log_probs"], before)
    del shards
    return out


def _check(data: int, tensor: int, results: list[dict[str, object]]) -> None:
    for rank, by_tensor in enumerate(results):
        result = by_tensor[tensor]  # type: ignore[index]
        stats = result["stats"]
        assert stats.path == "reshard" and stats.tensor_parallel_size == tensor
        assert not result["mismatched"], f"rank {rank}: wrong generation shards {result['mismatched'][:4]}"
        assert stats.bytes_received == stats.lower_bound_bytes > 0, stats
        model = result["model_bytes"]
        # the generation phase holds the training shard plus only what the micro-DP group gathered
        new = result["generation_bytes"] - result["training_bytes"]
        assert new == result["target_bytes"] - stats.aliased_bytes, (rank, new, stats)
        if data == tensor:
            # every weight but the (replicated) norms is a view of the FSDP shard: the generation phase holds M/tg
            # (the training shards) plus the full norms, nothing else
            assert result["training_bytes"] == model // tensor
            assert stats.aliased_bytes == model // tensor - result["replicated_bytes"] // tensor, stats
            assert result["generation_bytes"] == model // tensor + result["replicated_bytes"], result
        # park=True: the same shards and bytes, and the FSDP storage released into them: resident = the generation
        # shards alone (M/tg + the norms' other halves), never a shard twice; then restored bit for bit
        park = result["park_stats"]
        assert not result["park_mismatched"], f"rank {rank}: wrong parked generation shards"
        assert park.bytes_received == park.lower_bound_bytes == stats.bytes_received, park
        assert park.parked_bytes == result["training_bytes"] - park.aliased_bytes, park
        assert result["parked_training_bytes"] == park.aliased_bytes, result
        assert result["parked_generation_bytes"] == result["parked_target_bytes"] == result["target_bytes"], result
        assert result["parked_generation_bytes"] <= model // tensor + result["replicated_bytes"], result
        assert result["restored_equal"] and result["restored_training_bytes"] == result["training_bytes"], result
        assert result["forward_after_park_equal"], f"rank {rank}: log-probs changed across a park / restore"


def test_default_handover_reaches_the_lower_bound_on_two_ranks(tmp_path: Path) -> None:
    run_rank_groups([(_generation_rank, 2, ([1, 2], str(tmp_path)))], workdir=tmp_path, timeout_s=240)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    _check(2, 1, results)
    _check(2, 2, results)


@pytest.mark.slow
def test_default_handover_reaches_the_lower_bound_on_four_ranks(tmp_path: Path) -> None:
    run_rank_groups([(_generation_rank, 4, ([1, 2, 4], str(tmp_path)))], workdir=tmp_path, timeout_s=400)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(4)]
    for tensor in (1, 2, 4):
        _check(4, tensor, results)
