"""Dispatch+collect latency of a worker group vs the plain-Ray zero-copy floor, measured side by side.

For B in {1024, 8192} rows of int64 [B,1024] + float32 [B,1024] and W in {2, 4} CPU workers, each config times
``group.worker.echo(batch)`` (return the shard) and ``reduce`` (return a row sum) through the controller
(protocol dp_compute, blocking) against the floor doing the same work in plain Ray: the driver puts each rank's
shard once (numpy views, each byte stored once, as the controller does), each plain actor gets its shard zero-copy
as a task argument and returns its result, the driver gets them and joins them into one array per column (what
the controller returns). Calls alternate, ours first on even calls and the floor first on odd ones, so both see
the same load; each round takes the ratio of the two medians, and the reported ratio is the median over rounds.
``floor_get_ms`` is the floor stopped when ``ray.get`` returned (per-rank pieces, not yet one batch), for reference.
``cpu_ratio`` compares CPU seconds (driver + the worker processes, from /proc) per call: on a loaded box it moves
far less than wall time.

Prints one line per config: ``RESULT {"B", "W", "method", "median_ms", "floor_median_ms", "floor_get_ms",
"ratio_to_floor", "round_ratios", "ratio_to_get", "cpu_ratio"}``.

Run: ``OMP_NUM_THREADS=1 python bench/controller.py [--rounds 5] [--repeats 5] [--sizes 1024,8192] [--workers 2,4]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import ray
import torch

import results_page
from hybridflow.batch import Batch
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, init_ray, register

COLUMNS = 1024
METHODS = ("echo", "reduce")


class EchoWorker(Worker):
    """The controller side: dp_compute methods that echo or reduce their shard."""

    @register(protocol="dp_compute")
    def echo(self, batch: Batch) -> Batch:
        return batch

    @register(protocol="dp_compute")
    def reduce(self, batch: Batch) -> Batch:
        total = batch["input_ids"].sum(dim=1).to(torch.float64) + batch["values"].sum(dim=1).to(torch.float64)
        return Batch({"row_sum": total}, meta=batch.meta)


@ray.remote(num_cpus=0.01)
class FloorActor:
    """The floor side: plain Ray, a numpy shard in (zero-copy task argument), numpy out."""

    def pid(self) -> int:
        return os.getpid()

    def echo(self, shard: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return shard

    def reduce(self, shard: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        ids, values = (torch.from_numpy(column) for column in shard)  # the same arithmetic as EchoWorker.reduce
        return (ids.sum(dim=1).to(torch.float64) + values.sum(dim=1).to(torch.float64)).numpy()


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far; 0 where /proc is unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_floor(actors: list[Any], ids: np.ndarray, values: np.ndarray, method: str) -> tuple[float, float]:
    """One plain-Ray dispatch + collect; returns (ms until one array per column, ms until ray.get returned)."""
    started = time.perf_counter()
    bounds = np.linspace(0, len(ids), len(actors) + 1).astype(int)
    refs = [ray.put((ids[lo:hi], values[lo:hi])) for lo, hi in itertools.pairwise(bounds)]
    outputs = ray.get([getattr(actor, method).remote(ref) for actor, ref in zip(actors, refs)], timeout=120)
    got = time.perf_counter()
    if method == "echo":
        result = [np.concatenate([output[column] for output in outputs]) for column in range(2)]
    else:
        result = [np.concatenate(outputs)]
    assert len(result[0]) == len(ids)
    done = time.perf_counter()
    return (done - started) * 1000, (got - started) * 1000


def run_controller(group: WorkerGroup, batch: Batch, method: str) -> float:
    started = time.perf_counter()
    output = group.worker.echo(batch) if method == "echo" else group.worker.reduce(batch)
    assert len(output) == len(batch)
    return (time.perf_counter() - started) * 1000


def measure(call: Callable[[], Any], pids: list[int]) -> tuple[Any, float]:
    """``call()``'s result and the CPU seconds the driver and processes ``pids`` spent meanwhile."""
    before = time.process_time() + sum(process_cpu_s(pid) for pid in pids)
    result = call()
    return result, time.process_time() + sum(process_cpu_s(pid) for pid in pids) - before


def bench_config(group: WorkerGroup, actors: list[Any], pids: list[int], size: int, method: str, rounds: int,
                 repeats: int) -> dict[str, Any]:
    generator = np.random.default_rng(size)
    ids = generator.integers(0, 50_000, size=(size, COLUMNS), dtype=np.int64)
    values = generator.standard_normal((size, COLUMNS), dtype=np.float32)
    batch = Batch({"input_ids": torch.from_numpy(ids), "values": torch.from_numpy(values)},
                  meta={"policy_version": 0, "iteration": 0})
    for _ in range(2):  # warm up both paths (object store pages, actor code, numpy pools)
        run_controller(group, batch, method), run_floor(actors, ids, values, method)
    ours: list[float] = []
    floor: list[float] = []
    floor_get: list[float] = []
    cpu_ours = cpu_floor = 0.0
    round_ratios = []
    for _ in range(rounds):
        round_ours, round_floor = [], []
        for call in range(repeats):
            for side in ((0, 1) if call % 2 == 0 else (1, 0)):
                if side == 0:
                    elapsed, cpu = measure(lambda: run_controller(group, batch, method), pids)
                    round_ours.append(elapsed)
                    cpu_ours += cpu
                else:
                    (elapsed, got), cpu = measure(lambda: run_floor(actors, ids, values, method), pids)
                    round_floor.append(elapsed)
                    floor_get.append(got)
                    cpu_floor += cpu
        round_ratios.append(statistics.median(round_ours) / statistics.median(round_floor))
        ours += round_ours
        floor += round_floor
    return {
        "B": size, "W": len(actors), "method": method, "median_ms": round(statistics.median(ours), 2),
        "floor_median_ms": round(statistics.median(floor), 2), "floor_get_ms": round(statistics.median(floor_get), 2),
        "ratio_to_floor": round(statistics.median(round_ratios), 3),
        "round_ratios": [round(ratio, 3) for ratio in round_ratios],
        "ratio_to_get": round(statistics.median(ours) / statistics.median(floor_get), 3),
        "cpu_ratio": round(cpu_ours / cpu_floor, 3) if cpu_floor > 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="calls per side per round")
    parser.add_argument("--sizes", default="1024,8192")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--num-cpus", type=int, default=4)
    options = parser.parse_args()
    torch.set_num_threads(1)
    init_ray(num_cpus=options.num_cpus, object_store_memory=1_000_000_000)
    worlds = [int(w) for w in options.workers.split(",")]
    for world in worlds:
        pool = ResourcePool(f"bench{world}", [world], cpus_per_worker=options.num_cpus / (2 * max(worlds)))
        group = WorkerGroup(pool, EchoWorker, name=f"bench{world}", deadline_s=120, setup_deadline_s=600)
        actors = [FloorActor.remote() for _ in range(world)]  # type: ignore[attr-defined]
        pids = list(group.process_ids.values()) + list(ray.get([actor.pid.remote() for actor in actors], timeout=120))
        for size in [int(b) for b in options.sizes.split(",")]:
            for method in options.methods.split(","):
                result = bench_config(group, actors, pids, size, method, options.rounds, options.repeats)
                results_page.result(result)
        group.shutdown()
        for actor in actors:
            ray.kill(actor)
        pool.release()


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Worker-group dispatch + collect vs the plain-Ray floor"))
