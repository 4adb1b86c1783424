"""``count_storage_bytes``: distinct storages once each (views and aliases are not counted twice), freed storages
count 0, and a DeepSpeed ZeRO-3 parameter counts its partition (``ds_tensor``) besides its own, empty, data."""

from __future__ import annotations

import torch

from hybridflow.resharding import count_storage_bytes


def test_views_count_once_and_freed_storage_counts_nothing() -> None:
    base = torch.zeros(8, 4)
    assert count_storage_bytes([base, base[:2], base.view(-1)[5:]]) == 8 * 4 * 4
    other = torch.zeros(3, dtype=torch.float64)
    assert count_storage_bytes([base, other]) == 8 * 4 * 4 + 3 * 8
    base.untyped_storage().resize_(0)  # released, as the fsdp handover parks a shard
    assert count_storage_bytes([base, other]) == 3 * 8


def test_zero3_partition_counts_beside_the_parameters_empty_data() -> None:
    flat = torch.zeros(10)  # ZeRO-3 may place several partitions in one flat buffer
    first, second = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    first.ds_tensor = flat[:6]  # type: ignore[attr-defined]  # the attribute DeepSpeed sets
    second.ds_tensor = flat[6:]  # type: ignore[attr-defined]
    assert count_storage_bytes([first, second]) == 10 * 4
