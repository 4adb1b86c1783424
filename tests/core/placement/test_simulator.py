"""Simulator: monotonicity in devices, scaling with work, the transition formula and cost-model overrides."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.placement import (
    LLAMA_PRESETS,
    GenerationConfig,
    ParallelConfig,
    Simulator,
    Workload,
    build_cluster,
    estimate_transition_bytes,
)
from hybridflow.placement.profiles import InterconnectProfile

MODEL = LLAMA_PRESETS["7b"]


def _pure_compute_simulator(devices: int) -> Simulator:
    """A cluster whose links are free, so stage times are compute alone."""
    cluster = build_cluster("a100", devices)
    free = InterconnectProfile(name="free", bandwidth=1e30, latency=0.0)
    cluster = replace(cluster, device=replace(cluster.device, intra_node=free, inter_node=free))
    return Simulator(cluster=cluster, workload=Workload())


@settings(deadline=None)
@given(devices=st.integers(1, 256), extra=st.integers(1, 256))
def test_more_devices_never_slow_a_pure_compute_stage(devices: int, extra: int) -> None:
    simulator = _pure_compute_simulator(devices + extra)
    few = ParallelConfig(pipeline=1, tensor=1, data=devices)
    more = ParallelConfig(pipeline=1, tensor=1, data=devices + extra)
    sequences = 1024.0
    assert simulator.infer_seconds("reference", MODEL, more, sequences) <= simulator.infer_seconds(
        "reference", MODEL, few, sequences)
    assert simulator.train_seconds("actor", MODEL, more, sequences) <= simulator.train_seconds(
        "actor", MODEL, few, sequences)


@settings(deadline=None)
@given(sequences=st.integers(1, 4096), factor=st.integers(2, 8))
def test_more_work_takes_longer(sequences: int, factor: int) -> None:
    simulator = Simulator(cluster=build_cluster("a100", 16), workload=Workload())
    config = ParallelConfig(pipeline=2, tensor=4, data=2)
    for stage in (simulator.train_seconds, simulator.infer_seconds):
        assert stage("actor", MODEL, config, sequences * factor) > stage("actor", MODEL, config, sequences)


def test_tensor_parallel_costs_communication() -> None:
    simulator = Simulator(cluster=build_cluster("a100", 8), workload=Workload())
    pure = _pure_compute_simulator(8)
    config = ParallelConfig(pipeline=1, tensor=8, data=1)
    assert simulator.infer_seconds("r", MODEL, config, 256) > pure.infer_seconds("r", MODEL, config, 256)


def test_generation_is_memory_bound_and_kv_limited() -> None:
    simulator = Simulator(cluster=build_cluster("a100", 8), workload=Workload())
    train = ParallelConfig(pipeline=1, tensor=8, data=1)
    generation = GenerationConfig(pipeline=1, tensor=8)
    roomy = simulator.generate_seconds("actor", MODEL, train, generation, 512, kv_cache_bytes=40e9)
    tight = simulator.generate_seconds("actor", MODEL, train, generation, 512, kv_cache_bytes=2e9)
    assert tight > roomy  # less KV cache → more waves
    assert simulator.generate_seconds("actor", MODEL, train, generation, 512, kv_cache_bytes=1e3) == float("inf")
    faster_memory = replace(simulator.cluster, device=replace(simulator.cluster.device, memory_bandwidth=4e12))
    quicker = Simulator(cluster=faster_memory, workload=Workload())
    assert quicker.generate_seconds("actor", MODEL, train, generation, 512, kv_cache_bytes=40e9) < roomy


@pytest.mark.parametrize(("p", "t", "pg", "tg", "expected"), [
    (1, 8, 1, 8, 0.0), (1, 8, 1, 4, 1 / 8), (1, 8, 1, 2, 3 / 8), (2, 4, 1, 2, 3 / 8), (1, 4, 1, 1, 3 / 4)])
def test_transition_bytes_match_the_papers_formula(p: int, t: int, pg: int, tg: int, expected: float) -> None:
    assert estimate_transition_bytes(1.0, p, t, 3, pg, tg) == pytest.approx(expected)


class _FixedCost:
    """A test double for an engine plugin's cost model: fixed training time, defers everything else."""

    def train_seconds(self, **_: object) -> float | None:
        return 1234.0

    def infer_seconds(self, **_: object) -> float | None:
        return None

    def generate_seconds(self, **_: object) -> float | None:
        return None


def test_cost_model_override_replaces_only_what_it_returns() -> None:
    from hybridflow.placement import CostModel

    override = _FixedCost()
    assert isinstance(override, CostModel)
    base = Simulator(cluster=build_cluster("a100", 8), workload=Workload())
    simulator = replace(base, overrides={"actor": override})
    config = ParallelConfig(pipeline=1, tensor=8, data=1)
    assert simulator.train_seconds("actor", MODEL, config, 64) == 1234.0
    assert simulator.train_seconds("critic", MODEL, config, 64) == base.train_seconds("critic", MODEL, config, 64)
    assert simulator.infer_seconds("actor", MODEL, config, 64) == base.infer_seconds("actor", MODEL, config, 64)
