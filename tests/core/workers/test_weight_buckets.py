"""Weights cross from the training pool to the rollout pool in buckets of bounded bytes (hybridflow.workers.rollout)."""

from __future__ import annotations

import torch

from hybridflow.workers.rollout import pack_weight_buckets, unpack_weight_buckets


def test_buckets_are_bounded_and_round_trip_every_tensor_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [("a", torch.randn(10, 10, generator=generator)), ("b", torch.randn(30, generator=generator)),
               ("c", torch.randn(4, 5, generator=generator).to(torch.bfloat16)),
               ("d", torch.randn(200, generator=generator)), ("e", torch.randn(3, generator=generator))]
    buckets = pack_weight_buckets(iter(weights), bucket_bytes=512)
    # a (400 B) fits alone; b would overflow it; c is another dtype; d (800 B) is larger than a bucket: its own
    assert [[entry[0] for entry in bucket.entries] for bucket in buckets] == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert all(bucket.nbytes <= 512 for bucket in buckets if len(bucket.entries) > 1 or bucket.entries[0][0] != "d")
    restored = list(unpack_weight_buckets(buckets))
    assert [name for name, _ in restored] == [name for name, _ in weights]
    for (_, got), (_, expected) in zip(restored, weights):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    packed = pack_weight_buckets(iter(weights[:2]), bucket_bytes=1 << 20)
    assert len(packed) == 1 and packed[0].nbytes == (100 + 30) * 4
