"""ZeRO-3 parking at generation tensor-parallel size tg = 2 on d = 2 gloo ranks (the actor worker's ``park=True``
path): the flat partition buffer is released although the row-parallel weights' partitions (flat rows) lie only
partly in this rank's tensor-parallel shards (columns); the bytes outside them are kept aside. Counted from storages,
as the run ledger counts them, a rank holds its generation shards plus exactly those aside bytes while generating,
not its partitions next to the shards; after generation the partitions are back bit for bit and training goes on as
if nothing had been generated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.testing.contracts.spawn import run_ranks

pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/setup.sh --all)")
pytestmark = pytest.mark.deepspeed


def _engine() -> Any:
    from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
    from hybridflow.presets import tiny_model_config
    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

    # vocab 46 so that tg = 2 splits the embedding evenly; every parameter partitioned (none kept gathered)
    model = ModelSpec(config={**tiny_model_config(), "vocab_size": 46}, seed=3)
    config = TrainingEngineConfig(model=model, optim=OptimConfig(lr=1e-2), micro_batch_size=2,
                                  extra={"zero_stage": 3, "param_persistence_threshold": 0})
    return DeepSpeedTrainingEngine(role="actor", config=config)


def _outside_bytes(engine: Any, rank: int, world_size: int) -> int:
    """Bytes of this rank's ZeRO-3 partitions that its tg = 2 generation shards do not hold, found by slicing an index
    tensor of each full weight (independent of the parking code's boxes)."""
    from hybridflow_deepspeed.layouts import flat_partition_range

    parameters = dict(engine.module.named_parameters())
    index = {name: torch.arange(p.ds_numel, dtype=torch.float64).view(p.ds_shape) for name, p in parameters.items()}
    shards = engine.handover.generation_layout(tensor=2).extract_shards(index, rank)
    outside = 0
    for name, parameter in parameters.items():
        held = set(shards[name].reshape(-1).long().tolist())
        start, stop = flat_partition_range(parameter.ds_numel, world_size, rank)
        outside += sum(i not in held for i in range(start, stop)) * parameter.element_size()
    return outside


def _rank(rank: int, world_size: int, out_dir: str) -> None:
    from hybridflow.resharding import count_storage_bytes
    from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll

    batches = [build_training_batch(rows=8, seed=seed).chunk(world_size)[rank] for seed in range(3)]
    out: dict[str, Any] = {}
    engine = _engine()
    parameters = list(engine.module.parameters())
    engine.train_step(batches[0], loss_fn=sequence_mean_nll)
    training = count_storage_bytes(parameters)
    # before: park=False, the partitions stay next to the generation shards
    shards = dict(engine.generation_weights(tensor_parallel_size=2))  # copies: ZeRO-3 hands over no views
    out["unparked"] = count_storage_bytes([*parameters, *shards.values()])
    snapshot = [p.ds_tensor.detach().clone() for p in parameters]
    parked = dict(engine.generation_weights(tensor_parallel_size=2, park=True))
    out.update(stats=engine.last_handover_stats, training=training, outside=_outside_bytes(engine, rank, world_size),
               target=sum(t.numel() * t.element_size() for t in parked.values()),
               mismatched=sorted(n for n in shards if not torch.equal(shards[n], parked[n])),
               parked_training=count_storage_bytes(parameters),
               generation=count_storage_bytes([*parameters, *parked.values()]))
    del parked
    engine.end_generation()
    out["restored_equal"] = all(torch.equal(a, p.ds_tensor) for a, p in zip(snapshot, parameters, strict=True))
    out["restored"] = count_storage_bytes(parameters)
    losses = [engine.train_step(batches[1], loss_fn=sequence_mean_nll)["loss"]]
    held = dict(engine.generation_weights(tensor_parallel_size=2, park=True))  # a train step restores it first
    losses.append(engine.train_step(batches[2], loss_fn=sequence_mean_nll)["loss"])
    del held
    final = [p.ds_tensor.detach().clone() for p in parameters]
    engine.release()
    # the same steps, never generating
    reference = _engine()
    reference.train_step(batches[0], loss_fn=sequence_mean_nll)
    out["reference_losses"] = [reference.train_step(b, loss_fn=sequence_mean_nll)["loss"] for b in batches[1:]]
    out["losses"] = losses
    out["final_equal"] = all(torch.equal(a, p.ds_tensor) for a, p in zip(final, reference.module.parameters(),
                                                                         strict=True))
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def test_zero3_parks_at_tg2_with_the_rest_aside(tmp_path: Path) -> None:
    run_ranks(_rank, 2, str(tmp_path), workdir=tmp_path, timeout_s=300)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        stats = out["stats"]
        assert out["mismatched"] == [], out["mismatched"]
        assert stats.bytes_received == stats.lower_bound_bytes, stats
        # the whole flat partition buffer went; what of it lies in no tg = 2 shard here is all that stayed aside
        assert stats.parked_bytes == out["training"] > 0, (stats, out["training"])
        assert stats.aside_bytes == out["outside"] == out["parked_training"] > 0, (stats, out["outside"])
        assert out["generation"] == out["target"] + out["outside"], out
        # before: partitions (M/2, padded) next to the shards; after: the shards and about a quarter of the
        # row-parallel weights
        assert out["unparked"] == out["training"] + out["target"], out
        assert out["unparked"] - out["generation"] == out["training"] - out["outside"], out
        assert out["restored_equal"] and out["restored"] == out["training"], out
        assert out["final_equal"], "training after parked generations differs from training without them"
        assert all(math.isclose(a, b, rel_tol=0, abs_tol=0) for a, b in zip(out["losses"], out["reference_losses"],
                                                                           strict=True)), out
        print(f"RESULT rank {rank}: training {out['training']} B, generating unparked {out['unparked']} B, "
              f"parked {out['generation']} B (shards {out['target']} + aside {out['outside']})")
