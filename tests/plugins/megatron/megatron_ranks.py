"""One rank of a megatron engine scenario, run as its own process by the tests (gloo on CPU).

Usage: python megatron_ranks.py SCENARIO RANK WORLD PORT OUT_DIR JSON_ARGS; writes OUT_DIR/rank_<RANK>.pt.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch


def make_batch(rows: int = 8, prompt: int = 5, response: int = 4, seed: int = 1):
    """A synthetic rollout batch (left-padded prompts, right-padded responses) with GRPO-style columns."""
    from hybridflow.batch import Batch

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 45, (rows, prompt), generator=generator)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    for row in range(0, rows, 3):
        prompts[row, : row % prompt] = 0
        prompt_mask[row, : row % prompt] = 0
    responses = torch.randint(4, 45, (rows, response), generator=generator)
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[1::2, -1] = 0
    responses[response_mask == 0] = 0
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response, generator=generator),
        },
        meta={"policy_version": 0, "iteration": 0},
        batch_size=rows,
    )


def build_engine(args: dict, role: str = "actor"):
    from hybridflow.engines import ModelSpec, OptimConfig, ParallelConfig, TrainingEngineConfig
    from hybridflow.testing.fixtures import tiny_model_config
    from hybridflow_megatron.engine import build_megatron_training_engine

    values = {**tiny_model_config(**args.get("model", {})), **args.get("config", {})}  # e.g. vocab_size=64
    # an HF directory (e.g. save_tiny_model(perturb=...)) or a tiny config with random init
    spec = ModelSpec(path=args["path"]) if args.get("path") else ModelSpec(config=values, seed=args.get("seed", 3))
    config = TrainingEngineConfig(
        model=spec,
        parallel=ParallelConfig(tensor_parallel_size=args.get("tp", 1), pipeline_parallel_size=args.get("pp", 1)),
        optim=OptimConfig(lr=args.get("lr", 1e-2), grad_clip=args.get("grad_clip", 1.0)),
        micro_batch_size=args.get("micro_batch_size", 2),
        extra={"timeout_s": 90, **args.get("extra", {})},
    )
    return build_megatron_training_engine(role=role, config=config, device="cpu")


def scenario_train(args: dict) -> dict:
    """log-probs before, losses of ``steps`` train steps, log-probs after; this DP rank's slice of one batch."""
    from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn

    engine = build_engine(args)
    info = engine.mesh_info()
    batch = make_batch(rows=args.get("rows", 8))
    share = len(batch) // info.dp_size
    local = batch.slice(info.dp_rank * share, (info.dp_rank + 1) * share)
    before = engine.compute_log_probs(local, with_entropy=True)
    local = local | before.select("log_probs").with_meta()
    local["old_log_probs"] = before["log_probs"]
    loss_fn = make_actor_loss_fn(PolicyLossConfig(entropy_coef=args.get("entropy_coef", 0.01)))
    metrics = [engine.train_step(local, loss_fn=loss_fn, mini_batch_size=args.get("mini_batch_size"))
               for _ in range(args.get("steps", 2))]
    after = engine.compute_log_probs(local)
    return {"mesh": (info.dp_rank, info.dp_size, info.is_collect), "before": before["log_probs"],
            "entropy": before["entropy"], "after": after["log_probs"], "metrics": metrics,
            "version": engine.state_version()}


def scenario_logits(args: dict) -> dict:
    """Megatron logits/log-probs vs the HF model built from the same spec (pp=1 logits; any pp log-probs)."""
    from hybridflow_megatron.model import build_hf_model

    engine = build_engine(args, role=args.get("role", "actor"))
    batch = make_batch(rows=4)
    hf = build_hf_model(engine.config.model, role=engine.role).eval()
    with torch.no_grad():
        hf_logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    out = {"hf_logits": hf_logits, "attention_mask": batch["attention_mask"], "responses": batch["responses"]}
    if engine.role == "critic":
        out["values"] = engine.compute_values(batch)["values"]
    else:
        out["log_probs"] = engine.compute_log_probs(batch)["log_probs"]
    if engine.placement.pp_size == 1:
        from hybridflow_megatron.batching import attention_inputs

        ids, pos, mask = attention_inputs(batch, torch.device("cpu"))
        with torch.no_grad():
            out["logits"] = engine.module(ids, pos, attention_mask=mask)[..., : hf_logits.shape[-1]]
    weights = dict(engine.generation_weights()) if engine.role != "critic" else {}
    out["weights_equal"] = all(torch.equal(weights[k], v) for k, v in hf.state_dict().items() if k in weights)
    out["weights_missing"] = sorted(set(hf.state_dict()) - set(weights) - {"lm_head.weight"})
    out["hf_names"] = sorted(hf.state_dict())
    out["stats"] = engine.last_handover_stats
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _handover_case(args: dict) -> dict:
    """tg=1 handover twice (plan reuse), a vLLM tg=t target, then a train step and the reshard vs the gather path."""
    import torch.distributed as dist

    from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn
    from hybridflow.errors import ConfigError
    from hybridflow.resharding import GenerationLayout, lower_bound_bytes
    from hybridflow_megatron import gather
    from hybridflow_megatron.model import build_hf_model

    engine = build_engine(args)
    rank = dist.get_rank()
    hf_state = build_hf_model(engine.config.model, role="actor").state_dict()
    source = engine.layout()
    held = _nbytes(t for _, t in engine.iter_weight_shards())
    first = dict(engine.generation_weights())
    first_stats = engine.last_handover_stats
    target = engine.handover.generation_layout()
    plan = engine.handover.plan_for(target)
    second = dict(engine.generation_weights())
    out = {
        "stats": [first_stats, engine.last_handover_stats],
        "plan_reused": engine.handover.plan_for(engine.handover.generation_layout()) is plan,
        "buckets": len(plan.buckets),
        "lower_bound": lower_bound_bytes(source, target, rank),
        "full_minus_held": _nbytes(first.values()) - held,
        "names": sorted(first),
        "hf_names": sorted(hf_state),
        "unequal": sorted(n for n in first if not torch.equal(first[n], hf_state[n])),
        "second_unequal": sorted(n for n in first if not torch.equal(second[n], first[n])),
    }
    del first, second
    try:
        engine.generation_weights(target="sglang-fused")
    except ConfigError as error:
        out["bad_target"] = str(error)
    try:
        from hybridflow_vllm.layout import build_vllm_layout
    except ImportError:
        out["vllm"] = None
    else:
        shapes = {name: shape for name, (shape, _) in source.canonical_shapes().items()}
        mesh = GenerationLayout(tensor=engine.placement.tp_size, training=source.mesh)
        vllm_target = build_vllm_layout(shapes, model_config=dict(engine.config.model.config), mesh=mesh)
        shards = engine.reshard_weights(vllm_target)
        reference = vllm_target.extract_shards(hf_state, rank)
        out["vllm"] = {
            "stats": engine.last_handover_stats,
            "lower_bound": lower_bound_bytes(source, vllm_target, rank),
            "names_equal": sorted(shards) == sorted(reference),
            "unequal": sorted(n for n in reference if not torch.equal(shards[n], reference[n])),
            "fused": sorted(n for n in shards if "qkv_proj" in n or "gate_up_proj" in n),
        }
    info = engine.mesh_info()
    batch = make_batch(rows=4)
    local = batch.slice(info.dp_rank * len(batch) // info.dp_size, (info.dp_rank + 1) * len(batch) // info.dp_size)
    local["old_log_probs"] = engine.compute_log_probs(local)["log_probs"]
    engine.train_step(local, loss_fn=make_actor_loss_fn(PolicyLossConfig()))
    after = dict(engine.generation_weights())
    gathered, gather_stats = gather.gather_hf_state(engine.module, arch=engine.arch, placement=engine.placement)
    out["after_stats"] = engine.last_handover_stats
    out["gather_bytes"] = gather_stats.bytes_received
    out["after_vs_gather_unequal"] = sorted(n for n in gathered if not torch.equal(after[n], gathered[n]))
    out["after_changed"] = any(not torch.equal(after[n], hf_state[n]) for n in after)
    engine.release()
    return out


def _each_case(args: dict, run_case: Callable[[dict], dict]) -> dict:
    """Every case of ``args["cases"]`` (its own (p, t) over the same processes) through ``run_case``, Megatron's
    parallel state torn down after each."""
    from hybridflow_megatron.model import destroy_parallel_state

    results = []
    for case in args["cases"]:
        results.append(run_case({**args, **case}))
        destroy_parallel_state()
    return {"cases": results}


def scenario_handover(args: dict) -> dict:
    """Every case of ``args["cases"]`` through :func:`_handover_case`."""
    return _each_case(args, _handover_case)


def scenario_cases(args: dict) -> dict:
    """Every case of ``args["cases"]`` through the scenario it names (``"scenario": "train"``, ...) over the same
    processes: the tests that need several runs of one world size pay megatron's import once."""
    return _each_case(args, lambda case: SCENARIOS[case["scenario"]](case))


def _park_case(args: dict) -> dict:
    """For each tg of ``args["tensors"]``: the handover without and with ``park=True`` (the actor worker's path),
    resident weight bytes counted from storages while the generation shards are held, then ``end_generation()``; a
    second park left to the next forward, and a train step after a third."""
    from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn
    from hybridflow.resharding import count_storage_bytes
    from hybridflow_megatron.model import build_hf_model

    engine = build_engine(args)
    training = list(engine.model.parameters())
    hf_state = build_hf_model(engine.config.model, role="actor").state_dict()
    tied = engine.arch.tied_embeddings
    model_bytes = _nbytes(t for name, t in hf_state.items() if not (tied and name == "lm_head.weight"))
    info = engine.mesh_info()
    batch = make_batch(rows=4)
    local = batch.slice(info.dp_rank * len(batch) // info.dp_size, (info.dp_rank + 1) * len(batch) // info.dp_size)
    before = engine.compute_log_probs(local)["log_probs"]
    snapshot = [p.detach().clone() for p in training]
    out: dict = {"model_bytes": model_bytes, "training_bytes": count_storage_bytes(training),
                 "held_bytes": _nbytes(t for _, t in engine.iter_weight_shards())}
    for tensor in args["tensors"]:
        reference = {n: t.clone() for n, t in engine.generation_weights(tensor_parallel_size=tensor)}
        plain = engine.last_handover_stats
        shards = dict(engine.generation_weights(tensor_parallel_size=tensor, park=True))
        result = {"plain": plain, "stats": engine.last_handover_stats, "bucket": engine.handover.plan_for(
                      engine.handover.generation_layout(tensor=tensor)).max_bucket_cost(),
                  "mismatched": sorted(n for n in reference if not torch.equal(reference[n], shards[n])),
                  "names_equal": sorted(reference) == sorted(shards),
                  "parked_training_bytes": count_storage_bytes(training),
                  "generation_bytes": count_storage_bytes([*training, *shards.values()]),
                  "target_bytes": _nbytes(shards.values())}
        del shards
        engine.end_generation()
        result["restored_equal"] = all(torch.equal(a, p) for a, p in zip(snapshot, training, strict=True))
        result["restored_bytes"] = count_storage_bytes(training)
        shards = dict(engine.generation_weights(tensor_parallel_size=tensor, park=True))
        result["forward_after_park_equal"] = torch.equal(engine.compute_log_probs(local)["log_probs"], before)
        result["after_forward_equal"] = all(torch.equal(a, p) for a, p in zip(snapshot, training, strict=True))
        out[tensor] = result
        del shards, reference
    shards = dict(engine.generation_weights(tensor_parallel_size=args["tensors"][0], park=True))
    local["old_log_probs"] = before
    engine.train_step(local, loss_fn=make_actor_loss_fn(PolicyLossConfig()))  # restores before its forward
    out["stepped"] = any(not torch.equal(a, p) for a, p in zip(snapshot, training, strict=True))
    out["stepped_bytes"] = count_storage_bytes(training)
    del shards
    engine.release()
    return out


def scenario_park(args: dict) -> dict:
    """Every case of ``args["cases"]`` through :func:`_park_case`."""
    return _each_case(args, _park_case)

def scenario_park_steps(args: dict) -> dict:
    """A train step, then (``args["park"]``) for each tg of ``args["tensors"]`` a handover with ``park=True``: the
    resident training bytes counted from storages while parked, the parked bytes, a direct forward's error where the
    restore is a collective fetch-back, and after ``end_generation()`` whether every parameter is bit-identical to
    before; then a second train step and the parameters before and after it (to compare with an unparked run,
    ``park`` false, which skips the handovers)."""
    from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn
    from hybridflow.errors import EngineError
    from hybridflow.resharding import count_storage_bytes

    engine = build_engine(args)
    training = list(engine.model.parameters())
    info = engine.mesh_info()
    batch = make_batch(rows=4)
    local = batch.slice(info.dp_rank * len(batch) // info.dp_size, (info.dp_rank + 1) * len(batch) // info.dp_size)
    local["old_log_probs"] = engine.compute_log_probs(local)["log_probs"]
    loss_fn = make_actor_loss_fn(PolicyLossConfig())
    engine.train_step(local, loss_fn=loss_fn)
    shapes = engine.handover.generation_layout().canonical_shapes().values()
    out: dict = {"training_bytes": count_storage_bytes(training), "last_stage": engine.placement.is_last_stage,
                 "tied_copy": any(n == "output_layer.weight" for n, _ in engine.module.named_parameters()),
                 "model_bytes": sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes)}
    for tensor in args["tensors"] if args.get("park", True) else ():
        snapshot = [p.detach().clone() for p in training]
        shards = dict(engine.generation_weights(tensor_parallel_size=tensor, park=True))
        out[tensor] = {"stats": engine.last_handover_stats, "parked_training_bytes": count_storage_bytes(training),
                       "generation_bytes": count_storage_bytes([*training, *shards.values()]),
                       "target_bytes": _nbytes(shards.values()), "bucket": engine.handover.plan_for(
                           engine.handover.generation_layout(tensor=tensor)).max_bucket_cost()}
        if tensor > engine.placement.tp_size:  # tg beyond t: restoring fetches, a collective the hook refuses
            try:
                engine.module(None, None, attention_mask=None)
            except EngineError as error:
                out[tensor]["forward_error"] = str(error)
        del shards
        engine.handover.last_fetch_stats = None
        engine.end_generation()
        out[tensor]["restored_equal"] = all(torch.equal(a, p) for a, p in zip(snapshot, training, strict=True))
        out[tensor]["fetch"] = engine.handover.last_fetch_stats
    out["before"] = [p.detach().clone() for p in training]
    engine.train_step(local, loss_fn=loss_fn)
    out["after"] = [p.detach().clone() for p in training]
    engine.release()
    return out


SCENARIOS: dict[str, Callable[[dict], dict]] = {"train": scenario_train, "logits": scenario_logits,
                                                "handover": scenario_handover, "park": scenario_park,
                                                "park_steps": scenario_park_steps, "cases": scenario_cases}


def run_rank(rank: int, world: int, scenario: str, out_dir: str, args: dict[str, Any]) -> None:
    """Rank ``rank`` of ``scenario`` (RANK/WORLD_SIZE/MASTER_* set by the caller): writes OUT_DIR/rank_<RANK>.pt."""
    torch.set_num_threads(1)
    result = SCENARIOS[scenario](args)
    torch.save(result, os.path.join(out_dir, f"rank_{rank}.pt"))


def main() -> None:
    scenario, rank, world, port, out_dir = sys.argv[1:6]
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=world,
                      LOCAL_RANK=rank, OMP_NUM_THREADS="1")
    run_rank(int(rank), int(world), scenario, out_dir, args)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
