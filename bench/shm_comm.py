"""FSDP's all-gather and reduce-scatter on two CPU ranks of one host: gloo against the shared-memory comms the fsdp
engine installs by default (``extra.comm: auto``, hybridflow_fsdp/shm_comm.py), side by side in one run; and the
small all-reduce of tensor-parallel decoding (64 rows x hidden 512 in bf16, 64 KB) through gloo against the
shared-memory ``SpinChannel`` (``rollout.extra.comm: auto``).

Sizes are the 18.9M-parameter model of ``bench/e2e_sizes.py`` in bf16 (its one FSDP unit: a 38 MB all-gather output
and reduce-scatter input), alternating gloo and shm, medians of ``--repeats``. One ``RESULT {json}`` line with the
milliseconds and the gloo/shm ratios. The end-to-end effect: ``bench/e2e_grpo.py --size 20m --workers 2 --set
actor.extra.comm=gloo`` against the default.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=core:plugins/fsdp .venv/bin/python bench/shm_comm.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import results_page

ROOT = Path(__file__).resolve().parents[1]
NUMEL = 18_914_304


def _rank(rank: int, world_size: int, port: int, repeats: int, out: str) -> None:
    sys.path[:0] = [str(ROOT / "core"), str(ROOT / "plugins" / "fsdp")]
    from hybridflow_fsdp.shm_comm import SharedMemoryGroup, ShmAllGather, ShmReduceScatter, SpinChannel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    shared = SharedMemoryGroup(group)
    gather, scatter = ShmAllGather(shared), ShmReduceScatter(shared)
    channel = SpinChannel(group)
    activations = torch.zeros(64, 512, dtype=torch.bfloat16)  # stays 0 however often it is summed
    shard = NUMEL // world_size
    plain_out = torch.empty(NUMEL, dtype=torch.bfloat16)
    plain_in = torch.randn(NUMEL).to(torch.bfloat16)
    grad_out = torch.empty(shard, dtype=torch.bfloat16)

    def shm_all_gather() -> None:
        output = gather.allocate((NUMEL,), dtype=torch.bfloat16, device=torch.device("cpu"))
        gather(output, output[rank * shard:(rank + 1) * shard], group)

    def shm_reduce_scatter() -> None:
        source = scatter.allocate((NUMEL,), dtype=torch.bfloat16, device=torch.device("cpu"))
        result = scatter.allocate((shard,), dtype=torch.bfloat16, device=torch.device("cpu"))
        scatter(result, source, group, dist.ReduceOp.SUM)

    cases = {
        "all_gather": (lambda: dist.all_gather_into_tensor(plain_out, plain_in[:shard]), shm_all_gather),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(grad_out, plain_in), shm_reduce_scatter),
        "decode_all_reduce_x100": (lambda: [dist.all_reduce(activations) for _ in range(100)],
                                   lambda: [channel.all_reduce_(activations) for _ in range(100)]),
    }
    times: dict[str, dict[str, list[float]]] = {name: {"gloo": [], "shm": []} for name in cases}
    for name, (gloo_call, shm_call) in cases.items():
        gloo_call()
        shm_call()
        for _ in range(repeats):
            for system, call in (("gloo", gloo_call), ("shm", shm_call)):
                dist.barrier()
                started = time.perf_counter()
                call()
                times[name][system].append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    from hybridflow.controller.host import reserve_port

    reservation = reserve_port()
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "times.json")
        mp.spawn(_rank, args=(2, reservation.getsockname()[1], args.repeats, out), nprocs=2)
        times = json.loads(Path(out).read_text())
    reservation.close()
    result: dict[str, object] = {"ranks": 2, "bytes": NUMEL * 2, "dtype": "bfloat16", "repeats": args.repeats}
    for name, systems in times.items():
        gloo_ms = statistics.median(systems["gloo"]) * 1e3
        shm_ms = statistics.median(systems["shm"]) * 1e3
        result[name] = {"gloo_ms": round(gloo_ms, 2), "shm_ms": round(shm_ms, 2),
                        "gloo_over_shm": round(gloo_ms / shm_ms, 2)}
    results_page.result(result)


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="FSDP collectives on one host: gloo vs shared memory"))
