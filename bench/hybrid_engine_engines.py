"""What ``bench/hybrid_engine.py`` measures on every training engine, and its Megatron and DeepSpeed ZeRO-3 cases.

Shared by all engines (FSDP's case in ``hybrid_engine.py`` uses it too): the model, the prompts, the rollout engine
at tg, and ``hybridflow_phase`` — the actor worker's path (``generation_weights(tensor_parallel_size=tg, park=True)``
bound by the ``hf`` rollout engine, generate, ``sleep()``, ``end_generation()``).

Megatron (p, t, d) and DeepSpeed ZeRO-3 over d ranks: the engine is built once per training layout and generates at
every tg the trainer allows (tg dividing p·t, resp. d). Their two baselines run through the same executor as the
hybridflow plan, on the engine's own source shards (megatron's parameters, ZeRO-3's packed ``ds_tensor``
partitions), so bytes are counted from the buffers the collectives moved: ``full_gather`` (DeepSpeed-Chat: the whole
model all-gathered on every rank in one bucket, then cut, copied into the rollout engine) and ``per_tensor_allgather``
(OpenRLHF's two copies: the rollout engine keeps its own copy resident, synchronised tensor by tensor). Peak resident
weight bytes = distinct storages of training and rollout weights + the executor's high-water mark above
max(source, target) (``peak_extra_bytes``), for every scheme.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import torch

BUCKET_BYTES = 1 << 20
PROMPTS = 16
NEW_TOKENS = 16

#: Megatron (p, t) on 4 processes (d = 4 / (p·t)); each generates at every tg dividing p·t
MEGATRON_LAYOUTS = ((1, 2), (1, 4), (2, 2))
#: DeepSpeed ZeRO-3 options per case label suffix: every parameter partitioned, and DeepSpeed's default persistence
#: (the trainer's default: parameters under 1e5 elements stay gathered on every rank)
DEEPSPEED_OPTIONS: dict[str, dict[str, Any]] = {"": {"param_persistence_threshold": 0}, " persist=1e5": {}}

_HANDOVER_TRANSIENT = (
    "every rank parks (aside=\"fetch\") and while generating holds its generation shards alone (M/4), but the "
    "executor's high-water mark during the handover exceeds one bucket: buckets go in layer order, so a last-stage "
    "rank receives its quarter of layers 0-1 (M/8) before its own layers' shards are released (by the executor's "
    "accounting; megatron's flat param buffer really goes only at the handover's end)")
#: Layouts whose generation-phase peak exceeds M/(tg·pg) + one bucket, and why; the bench prints their measured
#: ratio and fails when a miss is not listed here or a listed one stops missing.
KNOWN_MISSES: dict[str, str] = {
    "megatron p=2 t=2 d=1 -> pg=1 tg=4": _HANDOVER_TRANSIENT,
}


def model_config() -> dict[str, Any]:
    from hybridflow.presets import tiny_model_config

    return tiny_model_config(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4,
                             vocab_size=64, max_position_embeddings=128)


def greedy() -> Any:
    from hybridflow.engines import SamplingParams

    return SamplingParams(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, seed=0)


def prompts_of(layout: Any, rank: int) -> Any:
    """This rank's share of the global prompt batch: split over the generation replicas (``layout.data``)."""
    from hybridflow.testing.contracts.rollout import build_prompt_batch

    base = build_prompt_batch()
    prompts = base.repeat_interleave(-(-PROMPTS // len(base))).slice(0, PROMPTS)
    return prompts.chunk(layout.data)[layout.coords(rank).data]


def build_rollout(spec: Any, tensor: int, groups: list[list[int]] | None) -> Any:
    """The ``hf`` rollout engine at tg = ``tensor`` over ``groups`` (global ranks in tensor-rank order)."""
    from hybridflow.char_tokenizer import EOS_ID, PAD_ID
    from hybridflow.engines import RolloutEngineConfig
    from hybridflow_fsdp.rollout import HFRolloutEngine

    groups_arg = tuple(tuple(group) for group in groups) if tensor > 1 else None
    return HFRolloutEngine(config=RolloutEngineConfig(model=spec, tensor_parallel_size=tensor, pad_token_id=PAD_ID,
                                                      eos_token_id=EOS_ID, max_prompt_length=16,
                                                      tensor_groups=groups_arg))


def hybridflow_phase(engine: Any, rollout: Any, training: Sequence[torch.Tensor], tensor: int,
                     mine: Any) -> dict[str, Any]:
    """The actor worker's path: handover with ``park=True`` bound by the (asleep) rollout engine, resident weight bytes
    counted from storages while generating, a warm-up and a timed greedy generation, ``sleep()``,
    ``end_generation()``."""
    import torch.distributed as dist

    from hybridflow.resharding import count_storage_bytes

    rollout.wake()
    rollout.update_weights(engine.generation_weights(tensor_parallel_size=tensor, park=True), version=1, bind=True)
    stats = engine.last_handover_stats
    assert stats is not None
    extra = getattr(stats, "peak_extra_bytes", None)
    extra = stats.peak_gathered_bytes if extra is None else extra  # fsdp's name for the executor's high-water mark
    resident = count_storage_bytes([*training, *rollout.model.parameters()])
    rollout.generate(mine, greedy())  # warm-up (first-call allocations)
    dist.barrier()
    started = time.perf_counter()
    generated = rollout.generate(mine, greedy())
    seconds = time.perf_counter() - started
    rollout.sleep()
    engine.end_generation()
    return {"received": stats.bytes_received, "lower_bound": stats.lower_bound_bytes,
            "peak_resident": resident + extra, "generation_resident": resident,
            "parked": getattr(stats, "parked_bytes", 0), "restore": getattr(stats, "restore_bytes", 0),
            "training_resident": count_storage_bytes([*training, *rollout.model.parameters()]),
            "generation_seconds": seconds, "responses": generated["responses"].tolist()}


def staged_baselines(rollout: Any, training: list[torch.Tensor], source: Any, target: Any, shards: Any,
                     rank: int) -> dict[str, Any]:
    """DeepSpeed-Chat's full gather and OpenRLHF's two copies, run by the executor on ``shards()`` (fresh source
    shards of ``source`` each call) into the rollout engine's own copy of ``target``."""
    from hybridflow.resharding import count_storage_bytes, execute_reshard, plan_reshard

    out: dict[str, Any] = {}
    schemes: tuple[tuple[str, Literal["full_gather", "per_tensor_allgather"]], ...] = (
        ("full_gather", "full_gather"), ("two_copies", "per_tensor_allgather"))
    for version, (scheme, strategy) in enumerate(schemes, start=2):
        plan = plan_reshard(source, target, strategy=strategy, bucket_bytes=BUCKET_BYTES)
        rollout.wake()
        with torch.no_grad():
            moved, stats = execute_reshard(plan, shards(), rank=rank)
            rollout.update_weights(list(moved.items()), version=version)  # copied into the engine's own storage
        del moved
        resident = count_storage_bytes(training + list(rollout.model.parameters()))
        out[scheme] = {"received": stats.bytes_received, "peak_resident": resident + stats.peak_extra_bytes,
                       "training_resident": resident}
        if scheme == "full_gather":  # DeepSpeed-Chat's engine sleeps in training; OpenRLHF's keeps its copy
            rollout.sleep()
            out[scheme]["training_resident"] = count_storage_bytes(training + list(rollout.model.parameters()))
    return out


def _measure(engine: Any, spec: Any, training: list[torch.Tensor], tensors: list[int], shards: Any,
             rank: int) -> dict[int, dict[str, Any]]:
    """Every tg of ``tensors`` on a built Megatron or DeepSpeed engine: hybridflow and the two baselines."""
    from hybridflow.resharding import GenerationLayout, count_storage_bytes
    from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll

    # a train step first, as the trainer's update_policy runs before each handover
    info = engine.mesh_info()
    batch = build_training_batch(rows=2 * info.dp_size).chunk(info.dp_size)[info.dp_rank]
    engine.train_step(batch, loss_fn=sequence_mean_nll)
    results = {}
    for tensor in tensors:
        layout = GenerationLayout(tensor=tensor, training=engine.parallel_layout())
        groups = [sorted(group, key=lambda r: layout.coords(r).tensor) for group in layout.tensor_groups()]
        rollout = build_rollout(spec, tensor, groups)
        target = engine.handover.generation_layout(tensor=tensor)
        out: dict[str, Any] = {
            "model_bytes": sum(torch.Size(shape).numel() * dtype.itemsize
                               for shape, dtype in target.canonical_shapes().values()),
            "training_only": count_storage_bytes(training), "bucket_cost": engine.handover.plan_for(
                target).max_bucket_cost(), "replica": layout.coords(rank).data,
            "tensor_rank": layout.coords(rank).tensor}
        rollout.sleep()
        out["hybridflow"] = hybridflow_phase(engine, rollout, training, tensor, prompts_of(layout, rank))
        out.update(staged_baselines(rollout, training, engine.handover.source_layout(), target, shards, rank))
        rollout.sleep()
        del rollout
        results[tensor] = out
    return results


def megatron_layout(rank: int, world: int, group: Any, pipeline: int, tensor: int,
                    tensors: list[int]) -> dict[int, dict[str, Any]]:
    """One Megatron (p, t, d = world/(p·t)) actor, every tg of ``tensors``; megatron's parallel state torn down."""
    from hybridflow.engines import ModelSpec, ParallelConfig, TrainingEngineConfig
    from hybridflow_megatron.engine import build_megatron_training_engine
    from hybridflow_megatron.model import destroy_parallel_state

    spec = ModelSpec(config=model_config(), seed=1)
    config = TrainingEngineConfig(
        model=spec, parallel=ParallelConfig(tensor_parallel_size=tensor, pipeline_parallel_size=pipeline),
        extra={"timeout_s": 600, "handover_bucket_bytes": BUCKET_BYTES})
    engine = build_megatron_training_engine(role="actor", config=config, device="cpu")
    try:
        return _measure(engine, spec, list(engine.model.parameters()), tensors,
                        lambda: dict(engine.iter_weight_shards()), rank)
    finally:
        engine.release()
        destroy_parallel_state()


def deepspeed_layout(rank: int, world: int, group: Any, options: dict[str, Any],
                     tensors: list[int]) -> dict[int, dict[str, Any]]:
    """One DeepSpeed ZeRO-3 actor over ``world`` ranks, every tg of ``tensors``."""
    from hybridflow.engines import ModelSpec, TrainingEngineConfig
    from hybridflow_deepspeed.training import DeepSpeedTrainingEngine

    spec = ModelSpec(config=model_config(), seed=1)
    config = TrainingEngineConfig(model=spec, extra={"zero_stage": 3, "timeout_s": 600,
                                                     "handover_bucket_bytes": BUCKET_BYTES, **options})
    engine = DeepSpeedTrainingEngine(role="actor", config=config)
    try:
        return _measure(engine, spec, list(engine.module.parameters()), tensors, engine.handover.local_shards, rank)
    finally:
        engine.release()


def engine_suites(world: int) -> list[tuple[str, Any, tuple[Any, ...], list[int]]]:
    """``(label, per-rank function, its arguments, tgs)`` of every Megatron and DeepSpeed case on ``world`` ranks."""
    suites: list[tuple[str, Any, tuple[Any, ...], list[int]]] = []
    for pipeline, tensor in MEGATRON_LAYOUTS:
        tgs = [tg for tg in (1, 2, 4) if (pipeline * tensor) % tg == 0]
        label = f"megatron p={pipeline} t={tensor} d={world // (pipeline * tensor)}"
        suites.append((label, megatron_layout, (pipeline, tensor, tgs), tgs))
    tgs = [tg for tg in (1, 2, 4) if world % tg == 0]
    for suffix, options in DEEPSPEED_OPTIONS.items():
        suites.append((f"deepspeed zero3 d={world}{suffix}", deepspeed_layout, (options, tgs), tgs))
    return suites
