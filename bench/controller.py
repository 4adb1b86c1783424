"""Dispatch+collect latency of a worker group vs the plain-Ray zero-copy floor, measured side by side.

For B in {64, 1024, 8192} rows of int64 [B,1024] + float32 [B,1024] and W in {2, 4} CPU workers, each config
times ``group.worker.echo(batch)`` (return the chunk) and ``reduce`` (return a row sum) through the controller
(protocol dp_compute, blocking) against the floor: the driver puts numpy chunks, plain actors return them (or
their row sums), the driver gets. Runs alternate so both see the same load. Prints one line per config:
``RESULT {"B", "W", "mode", "median_ms", "floor_median_ms", "ratio_to_floor"}``.

Run: ``OMP_NUM_THREADS=1 python bench/controller.py [--repeats 15] [--sizes 64,1024,8192] [--workers 2,4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import ray
import torch

from hybridflow.batch import Batch
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, init_ray, register

COLUMNS = 1024


class EchoWorker(Worker):
    """The controller side: dp_compute methods that echo or reduce their chunk."""

    @register(protocol="dp_compute")
    def echo(self, batch: Batch) -> Batch:
        return batch

    @register(protocol="dp_compute")
    def reduce(self, batch: Batch) -> Batch:
        total = batch["input_ids"].sum(dim=1).to(torch.float64) + batch["values"].sum(dim=1).to(torch.float64)
        return Batch({"row_sum": total}, meta=batch.meta)


@ray.remote(num_cpus=0.01)
class FloorActor:
    """The floor side: plain Ray, numpy chunks in, numpy chunks (or row sums) out."""

    def echo(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ids, values

    def reduce(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        return ids.sum(axis=1, dtype=np.float64) + values.sum(axis=1, dtype=np.float64)


def run_floor(actors: list, ids: np.ndarray, values: np.ndarray, mode: str) -> float:
    started = time.perf_counter()
    world = len(actors)
    id_chunks, value_chunks = np.array_split(ids, world), np.array_split(values, world)
    refs = [(ray.put(a), ray.put(b)) for a, b in zip(id_chunks, value_chunks)]
    calls = [getattr(actor, mode).remote(a, b) for actor, (a, b) in zip(actors, refs)]
    outputs = ray.get(calls, timeout=120)
    assert len(outputs) == world
    return (time.perf_counter() - started) * 1000


def run_controller(group: WorkerGroup, batch: Batch, mode: str) -> float:
    started = time.perf_counter()
    output = group.worker.echo(batch) if mode == "echo" else group.worker.reduce(batch)
    assert len(output) == len(batch)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", default="64,1024,8192")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--num-cpus", type=int, default=4)
    options = parser.parse_args()
    torch.set_num_threads(1)
    init_ray(num_cpus=options.num_cpus, object_store_memory=1_000_000_000)
    worlds = [int(w) for w in options.workers.split(",")]
    for world in worlds:
        pool = ResourcePool(f"bench{world}", [world], cpus_per_worker=options.num_cpus / (2 * max(worlds)))
        group = WorkerGroup(pool, EchoWorker, name=f"bench{world}", deadline_s=120)
        actors = [FloorActor.remote() for _ in range(world)]
        ray.get([actor.echo.remote(np.zeros(1), np.zeros(1)) for actor in actors], timeout=120)
        for size in [int(b) for b in options.sizes.split(",")]:
            generator = np.random.default_rng(size)
            ids = generator.integers(0, 50_000, size=(size, COLUMNS), dtype=np.int64)
            values = generator.standard_normal((size, COLUMNS), dtype=np.float32)
            batch = Batch({"input_ids": torch.from_numpy(ids), "values": torch.from_numpy(values)},
                          meta={"policy_version": 0, "iteration": 0})
            for mode in ("echo", "reduce"):
                run_controller(group, batch, mode), run_floor(actors, ids, values, mode)  # warm up
                ours, floor = [], []
                for _ in range(options.repeats):
                    ours.append(run_controller(group, batch, mode))
                    floor.append(run_floor(actors, ids, values, mode))
                median, floor_median = statistics.median(ours), statistics.median(floor)
                print("RESULT " + json.dumps({
                    "B": size, "W": world, "mode": mode, "median_ms": round(median, 2),
                    "floor_median_ms": round(floor_median, 2), "ratio_to_floor": round(median / floor_median, 3),
                }), flush=True)
        group.shutdown()
        for actor in actors:
            ray.kill(actor)
        pool.release()


if __name__ == "__main__":
    main()
