"""The placement-validation fixture shared by ``bench/placement_validation.py`` and the tests that replay its
measured rows (``tests/core/placement/data/measured_ppo_*``): PPO with four tiny Qwen2 models (actor, critic,
reference, reward) on 4 CPU slots sharing ``cores`` cores, the seven fixed placements the bench runs, the
data-parallel-only record of each (the fsdp engine shards over DP only, the hf rollout generates at tg = 1), and the
rank statistics the bench reports. Stability: internal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from hybridflow.placement import Workload, build_cluster, model_from_hf_config
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig
from hybridflow.placement.record import PlanInputs, PlanRecord, plan_inputs
from hybridflow.testing.fixtures import tiny_model_config

__all__ = ["ROLES", "SLOTS", "PLACEMENTS", "CALIBRATION", "Placement", "data_parallel_record", "tiny_ppo_inputs",
           "ranks", "spearman", "kendall"]

ROLES = ("actor", "critic", "reference", "reward")
SLOTS = 4
Placement = tuple[tuple[str, ...], ...]
_A, _C, _R, _W = ROLES
#: name → (sets, slots per set); every set's data-parallel size divides the 24 prompts and 96 rows. Saved rows are
#: named with ``_`` for ``|`` (``split-ar_cw.jsonl``).
PLACEMENTS: dict[str, tuple[Placement, tuple[int, ...]]] = {
    "colocate": ((ROLES,), (4,)),
    "standalone": (((_A,), (_C,), (_R,), (_W,)), (1, 1, 1, 1)),
    "split-ar|cw": (((_A, _R), (_C, _W)), (2, 2)),
    "split-a|crw": (((_A,), (_C, _R, _W)), (2, 2)),
    "split-acr|w": (((_A, _C, _R), (_W,)), (3, 1)),
    "split-a|cr|w": (((_A,), (_C, _R), (_W,)), (1, 1, 2)),
    "split-aw|c|r": (((_A, _W), (_C,), (_R,)), (2, 1, 1)),
}
#: the placements every calibration fits on (the rest are held out)
CALIBRATION = ("colocate", "standalone")


def tiny_ppo_inputs(*, cores: float | None = 2, batch: int = 24, samples: int = 4, prompt_length: int = 8,
                    response_length: int = 16) -> PlanInputs:
    """The search inputs of the bench: four tiny Qwen2 models, ``SLOTS`` CPU slots sharing ``cores`` cores (None:
    every slot computes on its own, as GPUs do)."""
    model = model_from_hf_config({**tiny_model_config(), "torch_dtype": "float32"}, name="tiny-qwen2")
    workload = Workload(prompts=batch, samples_per_prompt=samples, prompt_length=prompt_length,
                        response_length=response_length, mini_batches=1, micro_batch_size=32)
    cluster = replace(build_cluster("cpu", SLOTS, SLOTS), compute_units=cores)
    return plan_inputs("ppo", {role: model for role in ROLES}, cluster, workload)


def data_parallel_record(placement: Placement, devices: tuple[int, ...]) -> PlanRecord:
    """``placement`` with every model data-parallel over its set's slots, generating at tg = 1."""
    parallel = {role: ParallelConfig(pipeline=1, tensor=1, data=n)
                for group, n in zip(placement, devices, strict=True) for role in group}
    return PlanRecord(placement=placement, devices=devices, parallel=parallel,
                      generation={"actor": GenerationConfig(pipeline=1, tensor=1)})


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0; tied values share the mean of their ranks (two placements predicted equal are not ordered)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            out[order[position]] = (start + end) / 2
        start = end + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson correlation of the (tie-averaged) ranks; 1 − 6Σd²/(n(n²−1)) when there are no ties; NaN for fewer
    than two values or a constant side."""
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var > 0 else float("nan")


def kendall(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a: concordant minus discordant pairs over all pairs (ties count as neither)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return score / len(pairs) if pairs else float("nan")
