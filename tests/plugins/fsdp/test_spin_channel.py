"""The shared-memory channel of tensor-parallel decoding (shm_comm.SpinChannel) on real gloo ranks of this host:
the same sums bit for bit as gloo's all-reduce over many back-to-back calls (its slots are double-buffered), the
all-gather in group-rank order, tensors over a slot through gloo, and a silent peer ending in an error, not a hang."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.testing.contracts.spawn import run_rank_groups

CALLS = 500


def _rank(rank: int, world_size: int, out_file: str) -> None:
    import time

    import torch.distributed as dist

    from hybridflow_fsdp.shm_comm import SHM_DIR, SpinChannel, spin_channel_unsupported_reason

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    reason = spin_channel_unsupported_reason(group)
    channel = SpinChannel(group, timeout_s=2.0)
    dist.barrier()  # every rank has unlinked its file
    left = sorted(path.name for path in SHM_DIR.glob(f"{channel.prefix}*"))
    generator = torch.Generator().manual_seed(rank)
    mismatches = 0
    for call in range(CALLS):  # shapes and dtypes vary call to call, as prefill and decode steps do
        x = torch.randn(1 + call % 7, 64, generator=generator).to(torch.bfloat16 if call % 2 else torch.float32)
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        mismatches += int(not torch.equal(channel.all_reduce_(x), expected))
    gathered = channel.all_gather(torch.full((3,), float(rank)))
    big = torch.full((SpinChannel.SLOT_BYTES // 4 + 1,), float(rank + 1))  # one element over a slot: gloo
    calls_before = channel.calls
    channel.all_reduce_(big)
    through_gloo = channel.calls == calls_before and bool((big == 3.0).all())
    started = time.monotonic()
    error = ""
    if rank == 0:  # rank 1 never makes this call
        try:
            channel.all_reduce_(torch.ones(4))
        except RuntimeError as exc:
            error = str(exc)
    waited = time.monotonic() - started
    dist.barrier()
    torch.save({"reason": reason, "left": left, "mismatches": mismatches, "gathered": gathered,
                "through_gloo": through_gloo, "error": error, "waited": waited}, f"{out_file}.{rank}")


def test_spin_channel_sums_as_gloo_gathers_in_order_and_does_not_hang(tmp_path: Path) -> None:
    out_file = str(tmp_path / "spin.pt")
    run_rank_groups([(_rank, 2, (out_file,))], workdir=tmp_path, timeout_s=180)
    for rank in range(2):
        result = torch.load(f"{out_file}.{rank}", weights_only=False)
        assert result["reason"] is None and result["left"] == [], result
        assert result["mismatches"] == 0
        assert [part.tolist() for part in result["gathered"]] == [[0.0] * 3, [1.0] * 3]
        assert result["through_gloo"]
    zero = torch.load(f"{out_file}.0", weights_only=False)
    assert "rank 1 of the tensor group did not reach call" in zero["error"], zero["error"]
    assert 2.0 <= zero["waited"] < 30, zero["waited"]
