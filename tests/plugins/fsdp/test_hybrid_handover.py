"""Actor and rollout engine in the same 2 gloo processes: train, hand weights over shard by shard, generate;
bytes received equal the resharding lower bound, nothing of the rollout weights stays resident while asleep, and a
2-rank checkpoint resumes bit-identically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.engines import ModelSpec, OptimConfig, RolloutEngineConfig, SamplingParams, TrainingEngineConfig
from hybridflow.testing.contracts.rollout import build_prompt_batch, prepare_model
from hybridflow.testing.contracts.spawn import run_rank_groups
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll
from hybridflow.testing.fixtures import EOS_ID, PAD_ID

SAMPLING = SamplingParams(n=2, max_new_tokens=6, seed=5)


def _hybrid_rank(rank: int, world_size: int, model_path: str, workdir: str) -> None:
    from hybridflow.resharding.planner import lower_bound_bytes
    from hybridflow_fsdp.layouts import build_fsdp_training_layout, build_hf_rollout_layout
    from hybridflow_fsdp.rollout import HFRolloutEngine
    from hybridflow_fsdp.training import FSDPTrainingEngine

    spec = ModelSpec(path=model_path)
    # the default handover (the reshard planner) in buckets of 32 KiB: an eighth of this model at most in flight
    actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2, extra={"handover_bucket_bytes": 32 << 10}),
        device="cpu")
    rollout = HFRolloutEngine(config=RolloutEngineConfig(model=spec, pad_token_id=PAD_ID, eos_token_id=EOS_ID))
    batch = build_training_batch(rows=8).chunk(world_size)[rank]
    actor.train_step(batch, loss_fn=sequence_mean_nll)
    rollout.sleep()
    asleep_bytes = rollout.resident_weight_bytes()
    rollout.wake()
    rollout.update_weights(actor.generation_weights(), version=actor.state_version())
    stats = actor.last_handover_stats
    shapes = {name: tuple(p.shape) for name, p in rollout.model.named_parameters()}
    bound = lower_bound_bytes(build_fsdp_training_layout(shapes, data=world_size),
                              build_hf_rollout_layout(shapes, data=world_size), rank)
    generated = rollout.generate(build_prompt_batch(), SAMPLING)
    log_probs = actor.compute_log_probs(generated)["log_probs"]
    actor.export_hf(f"{workdir}/exported")
    checkpoint = f"{workdir}/checkpoint"
    actor.save_checkpoint(checkpoint)
    first = actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"]
    actor.load_checkpoint(checkpoint)
    second = actor.train_step(batch, loss_fn=sequence_mean_nll)["loss"]
    torch.save({
        "generated": generated, "actor_log_probs": log_probs, "stats": stats, "lower_bound": bound,
        "asleep_bytes": asleep_bytes, "awake_bytes": rollout.resident_weight_bytes(), "resumed": (first, second),
    }, f"{workdir}/rank{rank}.pt")


def _both_scenarios_rank(rank: int, world_size: int, model_path: str, workdir: str) -> None:
    _hybrid_rank(rank, world_size, model_path, workdir)
    _both_paths_rank(rank, world_size, model_path, workdir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both tests' scenarios, one after the other on one spawned 2-rank group (torch and transformers imported once
    per rank); each test reads its own results from the returned directory."""
    workdir = tmp_path_factory.mktemp("hybrid_handover")
    model_path = prepare_model(workdir)
    run_rank_groups([(_both_scenarios_rank, 2, (str(model_path), str(workdir)))], workdir=workdir, timeout_s=480)
    return workdir


def test_hybrid_engine_handover_on_two_ranks(two_ranks: Path) -> None:
    tmp_path = two_ranks
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    model_bytes = results[0]["awake_bytes"]
    for rank, result in enumerate(results):
        stats = result["stats"]
        assert stats.path == "reshard"  # the default
        assert stats.bytes_received == result["lower_bound"] == stats.lower_bound_bytes > 0, stats
        assert stats.bytes_total == model_bytes and stats.bytes_local + stats.bytes_received == model_bytes
        assert stats.peak_gathered_bytes < model_bytes / 2, "the handover must not gather the whole model at once"
        assert result["asleep_bytes"] == 0, f"rank {rank} kept {result['asleep_bytes']} weight bytes while asleep"
        generated = result["generated"]
        assert generated.meta["policy_version"] == 1
        gap = ((generated["rollout_log_probs"] - result["actor_log_probs"]) * generated["response_mask"]).abs().max()
        assert gap < 1e-4, f"rank {rank}: rollout log-probs differ from the actor's by {gap}"
        assert result["resumed"][0] == result["resumed"][1], (
            f"rank {rank}: resume not bit-identical {result['resumed']}"
        )
    assert results[0]["generated"].equals(results[1]["generated"]), "both ranks hold the same weights and seed"
    # the exported directory is the trained actor: a fresh engine from it generates the same rollout
    from hybridflow_fsdp.rollout import HFRolloutEngine

    fresh = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(path=str(tmp_path / "exported")),
                                                       pad_token_id=PAD_ID, eos_token_id=EOS_ID))
    again = fresh.generate(build_prompt_batch(), SAMPLING)
    assert torch.equal(again["responses"], results[0]["generated"]["responses"])
    assert torch.allclose(again["rollout_log_probs"], results[0]["generated"]["rollout_log_probs"], atol=1e-6)


def _both_paths_rank(rank: int, world_size: int, model_path: str, workdir: str) -> None:
    from hybridflow.resharding.planner import lower_bound_bytes
    from hybridflow_fsdp.layouts import build_fsdp_training_layout, build_hf_rollout_layout
    from hybridflow_fsdp.training import FSDPTrainingEngine

    spec = ModelSpec(path=model_path)
    results = {}
    for path in ("stream", "reshard"):
        actor = FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
            model=spec, optim=OptimConfig(lr=1e-2), micro_batch_size=2,
            extra={"handover": path, "handover_bucket_bytes": 64 << 10}), device="cpu")
        actor.train_step(build_training_batch(rows=8).chunk(world_size)[rank], loss_fn=sequence_mean_nll)
        weights = dict(actor.generation_weights())
        again = dict(actor.generation_weights())  # the cached plan is reused
        results[path] = {"weights": weights, "stats": actor.last_handover_stats, "again": again}
    shapes = {name: tuple(t.shape) for name, t in results["stream"]["weights"].items()}
    results["lower_bound"] = lower_bound_bytes(build_fsdp_training_layout(shapes, data=world_size),
                                               build_hf_rollout_layout(shapes, data=world_size), rank)
    torch.save(results, f"{workdir}/paths{rank}.pt")


def test_reshard_path_equals_stream_path_and_moves_the_lower_bound(two_ranks: Path) -> None:
    """extra.handover=reshard runs the 3D-HybridEngine planner/executor: same weights bit for bit as the streamed
    per-parameter gather, bytes measured from the collectives equal to the planner's lower bound, peak ≤ a bucket."""
    for rank in range(2):
        result = torch.load(two_ranks / f"paths{rank}.pt", weights_only=False)
        stream, reshard = result["stream"], result["reshard"]
        assert stream["weights"].keys() == reshard["weights"].keys()
        assert all(torch.equal(stream["weights"][k], reshard["weights"][k]) for k in stream["weights"])
        assert all(torch.equal(reshard["again"][k], reshard["weights"][k]) for k in reshard["weights"])
        assert reshard["stats"].path == "reshard" and stream["stats"].path == "stream"
        assert reshard["stats"].bytes_received == result["lower_bound"] == stream["stats"].bytes_received > 0
        assert reshard["stats"].peak_gathered_bytes <= 64 << 10
