"""Transfer protocols without Ray: how rows map to ranks, which ranks are collected, registry and fast concat."""

from __future__ import annotations

import pytest
import torch

from hybridflow import registries
from hybridflow.batch import PADDING_KEY, Batch
from hybridflow.engines import MeshInfo
from hybridflow.errors import ConfigError, DuplicateNameError, UnknownNameError, VersionMismatchError
from hybridflow.plugins import CORE_OWNER
from hybridflow.transfer import (
    PARALLEL_COPY_BYTES,
    TransferContext,
    concat_batches,
    get_protocol,
    protocol_names,
    register,
    split_rows,
)


def make(n: int, version: int = 3) -> Batch:
    return Batch({"ids": torch.arange(n * 2).view(n, 2)}, {"text": [f"r{i}" for i in range(n)]},
                 {"policy_version": version, "iteration": 7})


def context(world: int, mesh: list[MeshInfo] | None = None) -> TransferContext:
    return TransferContext(world_size=world, role="actor", method="m",
                           mesh_provider=(lambda: mesh) if mesh is not None else None)


def test_builtins_registered_by_core_owner() -> None:
    names = protocol_names()
    for name in ("one_to_all", "all_to_all", "dp_compute", "dp_compute_padded", "rank_zero", "mesh",
                 "mesh_balanced", "generation_mesh"):
        assert name in names
        assert registries.transfer_protocols.owner(name) == CORE_OWNER
    with pytest.raises(UnknownNameError, match='Did you mean "dp_compute"'):
        get_protocol("dp_compte")


def test_dp_compute_splits_rows_and_replicates_other_args() -> None:
    batch = make(8)
    inputs = get_protocol("dp_compute").distribute((batch, 0.5), {"flag": True}, context(4))
    assert [rank_input.args[0]["ids"][:, 0].tolist() for rank_input in inputs] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert all(rank_input.args[1] == 0.5 and rank_input.kwargs == {"flag": True} for rank_input in inputs)
    assert get_protocol("dp_compute").collect([i.args[0] for i in inputs], context(4)).equals(batch)
    with pytest.raises(ConfigError, match="dp_compute_padded"):
        get_protocol("dp_compute").distribute((make(6),), {}, context(4))


def test_dp_compute_padded_counts_trailing_padding_per_rank() -> None:
    inputs = get_protocol("dp_compute_padded").distribute((make(5),), {}, context(4))
    assert [len(i.args[0]) for i in inputs] == [2, 2, 2, 2]
    assert [i.padding_rows for i in inputs] == [0, 0, 1, 2]
    assert [int(i.args[0][PADDING_KEY].sum()) for i in inputs] == [0, 0, 1, 2]
    assert split_rows(make(3), 4, pad=True)[3][1] == 1


def test_mesh_replicates_inside_dp_groups_and_collects_one_rank_per_group() -> None:
    # 4 ranks = dp 2 × tp 2; collect from tp rank 1 of each dp group (like the last pipeline stage)
    mesh = [MeshInfo(dp_rank=r // 2, dp_size=2, is_collect=r % 2 == 1) for r in range(4)]
    protocol = get_protocol("mesh")
    inputs = protocol.distribute((make(4),), {}, context(4, mesh))
    assert [i.args[0]["ids"][:, 0].tolist() for i in inputs] == [[0, 2], [0, 2], [4, 6], [4, 6]]
    assert protocol.collect_ranks(context(4, mesh)) == [1, 3]
    broken = [MeshInfo(dp_rank=r // 2, dp_size=2, is_collect=True) for r in range(4)]
    with pytest.raises(ConfigError, match="exactly one collect rank per dp_rank"):
        protocol.collect_ranks(context(4, broken))


def rollout(lengths: list[int], samples: int, width: int = 12) -> Batch:
    """A GRPO-shaped batch: prompt group g's ``samples`` rows hold ``lengths[g]`` valid tokens each (uid ``p{g}``)."""
    rows = len(lengths) * samples
    mask = torch.zeros(rows, width, dtype=torch.long)
    for row in range(rows):
        mask[row, : lengths[row // samples]] = 1
    return Batch({"attention_mask": mask, "row": torch.arange(rows)},
                 {"uid": [f"p{row // samples}" for row in range(rows)]})


def test_mesh_balanced_evens_the_tokens_per_dp_rank_keeping_prompt_groups_whole() -> None:
    # long groups first: mesh gives dp rank 0 the 4 long groups (4·4·12 = 192 tokens) and rank 1 the short ones (32)
    batch = rollout([12, 12, 12, 12, 2, 2, 2, 2], samples=4)
    mesh = [MeshInfo(dp_rank=r // 2, dp_size=2, is_collect=r % 2 == 0) for r in range(4)]  # dp 2 × tp 2
    plain = get_protocol("mesh").distribute((batch,), {}, context(4, mesh))
    assert [int(i.args[0]["attention_mask"].sum()) for i in plain[::2]] == [192, 32]
    balanced = get_protocol("mesh_balanced").distribute((batch,), {"final": True}, context(4, mesh))
    parts = [i.args[0] for i in balanced]
    assert [int(part["attention_mask"].sum()) for part in parts[::2]] == [112, 112]
    assert [len(part) for part in parts] == [16] * 4 and balanced[0].kwargs == {"final": True}
    assert parts[0].equals(parts[1]) and parts[2].equals(parts[3])  # replicated inside each dp group
    rows = torch.cat([part["row"] for part in parts[::2]]).tolist()
    assert sorted(rows) == list(range(32))  # every row once
    for part in parts[::2]:  # whole groups of 4 consecutive rows, each group in its original row order
        uids, ids = list(part.non_tensors["uid"]), part["row"].tolist()
        assert all(len(set(uids[g:g + 4])) == 1 for g in range(0, 16, 4))
        assert all(ids[g:g + 4] == list(range(ids[g], ids[g] + 4)) for g in range(0, 16, 4))
    # the update returns metrics: one per dp group, as mesh collects them; a Batch result would not line up
    assert get_protocol("mesh_balanced").collect([{"loss": 1.0}, {"loss": 2.0}], context(4, mesh)) == [
        {"loss": 1.0}, {"loss": 2.0}]
    with pytest.raises(ConfigError, match=r"protocols\.m=mesh"):
        get_protocol("mesh_balanced").collect(parts[::2], context(4, mesh))
    assert not get_protocol("mesh_balanced").concatenates  # nor may a non-blocking result stay lazy


def test_mesh_balanced_keeps_the_order_where_it_cannot_do_better() -> None:
    from hybridflow.transfer.builtin_protocols import balanced_order

    mesh = [MeshInfo(dp_rank=r, dp_size=2, is_collect=True) for r in range(2)]
    even = rollout([5, 9, 9, 5], samples=2)  # already 28 tokens a rank
    assert balanced_order(even, 2) is None
    assert [i.args[0]["row"].tolist() for i in get_protocol("mesh_balanced").distribute((even,), {}, context(2, mesh))
            ] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert balanced_order(rollout([9, 9, 5], samples=2), 2) is None  # 3 groups cannot split evenly over 2 ranks
    assert balanced_order(rollout([12, 1], samples=2), 1) is None
    # without uids every row is its own group (PPO's n = 1): rows 0 and 1 (12 tokens) go to different ranks
    single = Batch({"attention_mask": rollout([12, 12, 1, 1], samples=1)["attention_mask"]})
    assert balanced_order(single, 2) == [0, 2, 1, 3]


def test_generation_mesh_follows_the_generation_positions() -> None:
    from hybridflow.resharding import GenerationLayout, ParallelLayout

    # FSDP d=4 → tg=2, stride grouping: tensor groups {0,2}, {1,3}; generation replicas (micro-DP members) 0, 1
    layout = GenerationLayout(tensor=2, training=ParallelLayout(data=4, data_sharded=True))
    assert layout.tensor_groups() == ((0, 2), (1, 3))
    mesh = [MeshInfo(dp_rank=r, dp_size=4, is_collect=True, generation=MeshInfo(
        dp_rank=layout.coords(r).data, dp_size=layout.data, is_collect=layout.coords(r).tensor == 0))
        for r in range(4)]
    protocol = get_protocol("generation_mesh")
    inputs = protocol.distribute((make(4),), {}, context(4, mesh))
    # every rank of a tensor group gets the same rows; the result is read from tensor rank 0 of each group
    assert [i.args[0]["ids"][:, 0].tolist() for i in inputs] == [[0, 2], [4, 6], [0, 2], [4, 6]]
    assert protocol.collect_ranks(context(4, mesh)) == [0, 1]
    # no generation positions (tg = 1): each rank its own replica, as dp_compute
    plain = [MeshInfo(dp_rank=0, dp_size=1, is_collect=r == 0) for r in range(4)]
    assert [i.args[0]["ids"][:, 0].tolist() for i in protocol.distribute((make(4),), {}, context(4, plain))] == [
        i.args[0]["ids"][:, 0].tolist() for i in get_protocol("dp_compute").distribute((make(4),), {}, context(4))]
    assert protocol.collect_ranks(context(4, plain)) == [0, 1, 2, 3]


def test_rank_zero_all_to_all_and_one_to_all() -> None:
    assert get_protocol("rank_zero").distribute((1,), {}, context(3))[1:] == [None, None]
    inputs = get_protocol("all_to_all").distribute(([1, 2, 3],), {"k": ["a", "b", "c"]}, context(3))
    assert [(i.args[0], i.kwargs["k"]) for i in inputs] == [(1, "a"), (2, "b"), (3, "c")]
    with pytest.raises(ConfigError, match="list of 3 items"):
        get_protocol("all_to_all").distribute(([1, 2],), {}, context(3))
    batch = make(2)
    assert all(i.args[0] is batch for i in get_protocol("one_to_all").distribute((batch,), {}, context(3)))


def test_user_register_validates_and_rejects_duplicates() -> None:
    class Incomplete:
        concatenates = True

        def distribute(self, args, kwargs, context):
            return []

    with pytest.raises(TypeError, match="collect_ranks, collect"):
        register("incomplete_protocol", Incomplete())
    with pytest.raises(DuplicateNameError, match="hybridflow \\(core\\)"):
        register("dp_compute", get_protocol("one_to_all"))


def test_concat_batches_matches_batch_concat_on_the_parallel_path() -> None:
    rows = PARALLEL_COPY_BYTES // (4 * 256) // 3 + 7
    parts = [Batch({"x": torch.randn(rows, 256), "b": torch.randn(rows, 4).to(torch.bfloat16)},
                   {"t": [str(i) for i in range(rows)]}, {"policy_version": 1}) for _ in range(4)]
    fast = concat_batches(parts)
    assert sum(p.nbytes() for p in parts) >= PARALLEL_COPY_BYTES
    assert fast.equals(Batch.concat(parts)) and fast["b"].dtype == torch.bfloat16
    with pytest.raises(VersionMismatchError, match="policy_version"):
        concat_batches([parts[0], parts[1].with_meta(policy_version=2), parts[2]])


def test_the_ranks_update_tokens_become_verls_global_seqlen_metrics() -> None:
    from hybridflow.algorithms.helpers import mean_over_ranks
    from hybridflow.workers.base import RANK_TOKENS_METRIC

    merged = mean_over_ranks([{"loss": 1.0, RANK_TOKENS_METRIC: 120.0}, {"loss": 3.0, RANK_TOKENS_METRIC: 100.0}])
    assert merged == {"loss": 2.0, "global_seqlen/min": 100.0, "global_seqlen/max": 120.0,
                      "global_seqlen/minmax_diff": 20.0, "global_seqlen/mean": 110.0}
    assert mean_over_ranks({"loss": 1.0}) == {"loss": 1.0}


def test_a_streamed_updates_global_seqlen_is_of_each_ranks_tokens_over_the_step() -> None:
    """Chunks of one streamed step: each rank's tokens summed over the chunks, then min/max/mean over the ranks (a
    mean over chunks of each chunk's min and max would be the step's tokens split in the wrong places)."""
    from hybridflow.algorithms.helpers import mean_over_chunks_and_ranks
    from hybridflow.workers.base import RANK_TOKENS_METRIC

    chunks = [[{"loss": 1.0, RANK_TOKENS_METRIC: 100.0}, {"loss": 3.0, RANK_TOKENS_METRIC: 120.0}],
              [{"loss": 5.0, RANK_TOKENS_METRIC: 80.0}, {"loss": 7.0, RANK_TOKENS_METRIC: 40.0}]]
    assert mean_over_chunks_and_ranks(chunks) == {
        "loss": 4.0, "global_seqlen/min": 160.0, "global_seqlen/max": 180.0, "global_seqlen/minmax_diff": 20.0,
        "global_seqlen/mean": 170.0}
    assert mean_over_chunks_and_ranks([{"loss": 1.0}, {"loss": 2.0}]) == {"loss": 1.5}
