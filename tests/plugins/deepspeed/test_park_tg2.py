"""ZeRO-3 parking at generation tensor-parallel size tg = 2 on d = 2 gloo ranks (the actor worker's ``park=True``
path), with DeepSpeed's persistence on (as the trainer's default, here at a threshold that keeps the attention
weights, norms and embedding gathered besides their partitions and partitions the MLP): while generating, counted from
storages as the run ledger counts them, a rank holds its tensor-parallel shards and nothing else: neither the flat
partition buffer, nor the persistent parameters' full data, nor an aside copy of the row-parallel partition rows
outside its columns. After generation the partitions and the full data are back bit for bit (each rank received
exactly what its shards lacked from its tensor-parallel peer) and training goes on as if nothing had been
generated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.testing.contracts.spawn import run_ranks

pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/setup.sh --all)")
pytestmark = pytest.mark.deepspeed


#: elements at or under which ZeRO-3 keeps a parameter gathered: q/k/v/o_proj, norms, biases and the embedding
#: (<= 64·64) persist, the MLP weights (64·128) are partitioned only
PERSISTENCE = 64 * 64


def _engine() -> Any:
    from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
    from hybridflow.presets import tiny_model_config
    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

    # vocab 46 so that tg = 2 splits the embedding evenly
    model = ModelSpec(config={**tiny_model_config(), "vocab_size": 46}, seed=3)
    config = TrainingEngineConfig(model=model, optim=OptimConfig(lr=1e-2), micro_batch_size=2,
                                  extra={"zero_stage": 3, "param_persistence_threshold": PERSISTENCE})
    return DeepSpeedTrainingEngine(role="actor", config=config)


def _missing_bytes(engine: Any, rank: int, world_size: int) -> int:
    """Bytes this rank's tg = 2 generation shards lack of what it holds in training (a partitioned parameter's ZeRO-3
    partition, a persistent one's full data), found by slicing an index tensor of each full weight (independent of
    the planner's boxes): what bringing the parked storages back must receive."""
    from hybridflow_deepspeed.layouts import flat_partition_range

    parameters = dict(engine.module.named_parameters())
    index = {name: torch.arange(p.ds_numel, dtype=torch.float64).view(p.ds_shape) for name, p in parameters.items()}
    shards = engine.handover.generation_layout(tensor=2).extract_shards(index, rank)
    missing = 0
    for name, parameter in parameters.items():
        held = set(shards[name].reshape(-1).long().tolist())
        start, stop = (0, parameter.ds_numel) if parameter.ds_persist else flat_partition_range(
            parameter.ds_numel, world_size, rank)
        missing += sum(i not in held for i in range(start, stop)) * parameter.element_size()
    return missing


def _state(parameters: list[Any]) -> list[torch.Tensor]:
    """Every parameter's ZeRO-3 partition and, for a gathered persistent one, its full data (copies)."""
    return [t.detach().clone() for p in parameters for t in ((p.ds_tensor, p.data) if p.ds_persist else (p.ds_tensor,))]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _rank(rank: int, world_size: int, out_dir: str) -> None:
    from hybridflow.resharding import count_storage_bytes
    from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll

    batches = [build_training_batch(rows=8, seed=seed).chunk(world_size)[rank] for seed in range(3)]
    out: dict[str, Any] = {}
    engine = _engine()
    parameters = list(engine.module.parameters())
    engine.train_step(batches[0], loss_fn=sequence_mean_nll)  # the persistent parameters are gathered after it
    persistent = [p for p in parameters if p.ds_persist]
    out["persistent"] = (len(persistent), len(parameters), all(p.data.numel() == p.ds_numel for p in persistent))
    out["persistent_bytes"] = count_storage_bytes([p.data for p in persistent])
    training = count_storage_bytes(parameters)
    # before: park=False, the partitions and the persistent parameters' full data stay next to the generation shards
    shards = dict(engine.generation_weights(tensor_parallel_size=2))  # copies: ZeRO-3 hands over no views
    out["unparked"] = count_storage_bytes([*parameters, *shards.values()])
    snapshot = _state(parameters)
    parked = dict(engine.generation_weights(tensor_parallel_size=2, park=True))
    out.update(stats=engine.last_handover_stats, training=training, missing=_missing_bytes(engine, rank, world_size),
               target=sum(t.numel() * t.element_size() for t in parked.values()),
               mismatched=sorted(n for n in shards if not torch.equal(shards[n], parked[n])),
               parked_training=count_storage_bytes(parameters),
               generation=count_storage_bytes([*parameters, *parked.values()]))
    del parked
    engine.end_generation()
    out["restore_stats"] = engine.handover.last_restore_stats
    out["restored_equal"] = _equal(snapshot, _state(parameters))
    out["restored"] = count_storage_bytes(parameters)
    losses = [engine.train_step(batches[1], loss_fn=sequence_mean_nll)["loss"]]
    held = dict(engine.generation_weights(tensor_parallel_size=2, park=True))  # a train step restores it first
    losses.append(engine.train_step(batches[2], loss_fn=sequence_mean_nll)["loss"])
    del held
    final = _state(parameters)
    engine.release()
    # the same steps, never generating
    reference = _engine()
    reference.train_step(batches[0], loss_fn=sequence_mean_nll)
    out["reference_losses"] = [reference.train_step(b, loss_fn=sequence_mean_nll)["loss"] for b in batches[1:]]
    out["losses"] = losses
    out["final_equal"] = _equal(final, _state(list(reference.module.parameters())))
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def test_zero3_parks_everything_at_tg2_with_persistent_parameters(tmp_path: Path) -> None:
    run_ranks(_rank, 2, str(tmp_path), workdir=tmp_path, timeout_s=300)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        stats = out["stats"]
        persistent, count, gathered = out["persistent"]
        assert 0 < persistent < count and gathered, out["persistent"]  # both kinds, the persistent ones whole
        assert out["mismatched"] == [], out["mismatched"]
        assert stats.bytes_received == stats.lower_bound_bytes, stats
        # the flat partition buffer and the persistent parameters' full data went, nothing of them stayed: the rank
        # holds exactly its generation shards (not the persistent weights twice, no aside rows)
        assert stats.parked_bytes == out["training"] > out["persistent_bytes"] > 0, (stats, out["training"])
        assert out["parked_training"] == 0, out
        assert out["generation"] == out["target"], out
        assert out["unparked"] == out["training"] + out["target"], out
        # the way back received exactly what the shards lacked (planned and moved)
        assert stats.restore_bytes == out["restore_stats"].bytes_received == out["missing"] > 0, (stats, out)
        assert out["restored_equal"] and out["restored"] == out["training"], out
        assert out["final_equal"], "training after parked generations differs from training without them"
        assert all(math.isclose(a, b, rel_tol=0, abs_tol=0) for a, b in zip(out["losses"], out["reference_losses"],
                                                                           strict=True)), out
        print(f"RESULT rank {rank}: training {out['training']} B (persistent full data {out['persistent_bytes']} B), "
              f"generating unparked {out['unparked']} B, parked {out['generation']} B (the shards alone), "
              f"received back {out['missing']} B")
