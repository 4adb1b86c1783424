"""Executor on 2–4 gloo processes: bit-exact shards, measured bytes equal the plan and the lower bound, source
shards consumed, peak extra memory within one bucket."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import ReshardError
from hybridflow.resharding import (
    STRATEGIES,
    GenerationLayout,
    ModelLayout,
    ParallelLayout,
    build_fsdp_layout,
    build_tensor_parallel_layout,
    execute_reshard,
    plan_reshard,
    tiny_llama_shapes,
)
from hybridflow.resharding.local_cluster import GlooCluster

from reshard_jobs import full_weights, reshard_job, reshard_twice_job

SHAPES = tiny_llama_shapes(bias=True)
BUCKET = 48 << 10


def _tp_case(p: int, t: int, d: int, pg: int, tg: int) -> tuple[ModelLayout, ModelLayout]:
    training = ParallelLayout(pipeline=p, tensor=t, data=d)
    return (build_tensor_parallel_layout(SHAPES, mesh=training),
            build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(pipeline=pg, tensor=tg, training=training),
                                         fuse_attention=(4, 2, 16), fuse_mlp=True))


def _check(results: list[dict], *, exact_lower_bound: bool, bucket: int | None) -> None:
    for rank, result in enumerate(results):
        assert result["names_equal"] and result["mismatched"] == [], f"rank {rank}: {result['mismatched']}"
        stats = result["stats"]
        assert result["source_left"] == 0, "the executor must consume the source shards"
        assert stats.bytes_received == result["planned_received"]
        assert stats.bytes_sent == result["planned_sent"]
        if exact_lower_bound:
            assert stats.bytes_received == result["lower_bound"]
        if bucket is not None:  # one bucket; a bucket above it holds a single parameter that alone exceeds it
            assert result["multi_param_buckets_within"]
            assert stats.peak_extra_bytes <= max(bucket, result["max_bucket_cost"]), (rank, stats)


@pytest.mark.parametrize("case", [(1, 4, 1, 1, 2), (2, 2, 1, 1, 2), (2, 2, 1, 1, 1), (1, 2, 2, 1, 1)])
def test_hybridflow_3d_cases(gloo_cluster: GlooCluster, case: tuple[int, int, int, int, int]) -> None:
    source, target = _tp_case(*case)
    results = gloo_cluster.run(reshard_job, source, target, "hybridflow", BUCKET, 0)
    _check(results, exact_lower_bound=True, bucket=BUCKET)


@pytest.mark.parametrize("tg", [1, 2, 4])
def test_fsdp_handover(gloo_cluster: GlooCluster, tg: int) -> None:
    source = build_fsdp_layout(SHAPES, data=4, dtype=torch.bfloat16)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=tg, training=source.mesh),
                                          dtype=torch.bfloat16)
    results = gloo_cluster.run(reshard_job, source, target, "hybridflow", BUCKET, 1)
    _check(results, exact_lower_bound=True, bucket=BUCKET)


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "hybridflow"])
def test_baselines_are_correct_and_cost_more(gloo_cluster: GlooCluster, strategy: str) -> None:
    source, target = _tp_case(1, 4, 1, 1, 2)
    results = gloo_cluster.run(reshard_job, source, target, strategy, BUCKET, 2)
    _check(results, exact_lower_bound=False, bucket=None)
    hybrid = plan_reshard(source, target)
    assert all(r["stats"].bytes_received >= 2 * hybrid.lower_bound_bytes(rank) for rank, r in enumerate(results))
    model_bytes = sum(shape.numel() * dtype.itemsize for shape, dtype in
                      [(torch.Size(s), d) for s, d in source.canonical_shapes().values()])
    if strategy in ("full_gather", "consecutive"):  # these materialise the whole model before slicing
        assert all(r["stats"].peak_extra_bytes >= model_bytes // 2 for r in results)
    else:  # tensor by tensor: far below the model
        assert all(r["stats"].peak_extra_bytes < model_bytes // 4 for r in results)


def test_inside_a_subgroup_of_two_ranks(gloo_cluster: GlooCluster) -> None:
    source = build_fsdp_layout(SHAPES, data=2)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=1, training=source.mesh))
    results = gloo_cluster.run(reshard_job, source, target, "hybridflow", BUCKET, 3, size=2)
    _check(results, exact_lower_bound=True, bucket=BUCKET)


def test_a_reused_plan_runs_without_redoing_its_layout_arithmetic(gloo_cluster: GlooCluster) -> None:
    """The trainer hands over with one plan every step: the per-rank indices, shapes and views are derived on the
    first run and kept on the plan (weights never are), so the second run on new weights is bit-exact too and asks
    no parameter spec for its pieces."""
    source = build_fsdp_layout(SHAPES, data=2)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=1, training=source.mesh))
    results = gloo_cluster.run(reshard_twice_job, source, target, BUCKET, size=2)
    for rank, result in enumerate(results):
        assert result["mismatched"] == [[], []], (rank, result["mismatched"])
        first, second = result["pieces_calls"]
        assert first > 0 and second == 0, (rank, result["pieces_calls"])


def test_single_rank_needs_no_process_group() -> None:
    source = build_tensor_parallel_layout(SHAPES, tensor=1)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=1, training=source.mesh),
                                          fuse_attention=(4, 2, 16), fuse_mlp=True)
    full = full_weights(source)
    out, stats = execute_reshard(plan_reshard(source, target), source.extract_shards(full, 0), rank=0)
    qkv = out["model.layers.1.self_attn.qkv_proj.weight"]
    expected = torch.cat([full[f"model.layers.1.self_attn.{m}_proj.weight"] for m in "qkv"])
    assert torch.equal(qkv, expected)
    assert stats.bytes_received == 0 and stats.bytes_sent == 0


def test_wrong_shards_are_rejected() -> None:
    source = build_tensor_parallel_layout(SHAPES, tensor=1)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=1, training=source.mesh))
    shards = source.extract_shards(full_weights(source), 0)
    shards["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ReshardError, match=r"model\.norm\.weight"):
        execute_reshard(plan_reshard(source, target), shards, rank=0)
    del shards["model.norm.weight"]
    with pytest.raises(ReshardError, match="missing"):
        execute_reshard(plan_reshard(source, target), shards, rank=0)


def test_on_release_sees_each_released_source_copied_into_its_target() -> None:
    """``on_release`` fires once per source shard the plan stops reading (not for a view's base), with the bucket's
    target shards already holding that source's bytes; a staged (baseline) plan refuses it."""
    source = build_tensor_parallel_layout(SHAPES, tensor=1)
    target = build_tensor_parallel_layout(SHAPES, mesh=GenerationLayout(tensor=1, training=source.mesh))
    full = full_weights(source)
    seen: dict[str, bool] = {}

    def release(name: str, targets: object) -> None:
        assert isinstance(targets, dict)
        seen[name] = torch.equal(targets[name], full[name])

    plan = plan_reshard(source, target, bucket_bytes=BUCKET)
    execute_reshard(plan, source.extract_shards(full, 0), rank=0, on_release=release)
    assert seen.keys() == set(SHAPES) and all(seen.values()), seen
    seen.clear()
    _, stats = execute_reshard(plan, source.extract_shards(full, 0), rank=0, views=True, on_release=release)
    assert seen == {} and stats.aliased_bytes > 0, "a shard that is a view of its source is never released"
    with pytest.raises(ReshardError, match="on_release"):
        execute_reshard(plan_reshard(source, target, strategy="full_gather"), source.extract_shards(full, 0),
                        rank=0, on_release=release)
