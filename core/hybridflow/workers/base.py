"""What every model-role worker shares: the :class:`RoleSpec` its engines are built from, and the base worker class
that builds the training engine, checkpoints it, reports its mesh position and counters and checks batch versions.

The role-specific methods (generate, update_policy, compute_values, ...) are :mod:`hybridflow.workers.roles`', which
re-exports :class:`RoleSpec`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Worker, register
from hybridflow.engines import (
    MeshInfo,
    RolloutEngineConfig,
    SamplingParams,
    TrainingEngine,
    TrainingEngineConfig,
    training_engine_info,
)
from hybridflow.errors import VersionMismatchError
from hybridflow.reliability.faults import FaultPlan, iteration_of_checkpoint, maybe_fail

#: an update's tokens on one data-parallel rank (its ``attention_mask`` sum), which the actor's update reports; the
#: driver's ``mean_over_ranks`` turns the ranks' values into verl's ``global_seqlen/min|max|minmax_diff|mean``
RANK_TOKENS_METRIC = "global_seqlen/rank"

__all__ = ["RANK_TOKENS_METRIC", "RoleSpec", "close_engine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleSpec:
    """How to build one role's engines inside a worker process.

    ``role`` is the engine kind (``actor``, ``critic``, ``reference``, ``reward_model``: the model head and methods
    its engine serves); ``name`` the role's name in the run (``cost_critic``), its checkpoint folder, ``role`` when
    unset. ``output_key`` renames the column a critic (``values``) or reward model (``scores``) returns.
    """

    role: str
    name: str | None = None
    engine: str
    engine_config: TrainingEngineConfig
    device: str = "cpu"
    threads: int = 1
    loss: Any = None
    mini_batch_size: int | None = None
    epochs: int = 1
    rollout_engine: str | None = None
    rollout_config: RolloutEngineConfig | None = None
    sampling: SamplingParams | None = None
    output_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _build_training_engine(spec: RoleSpec) -> TrainingEngine:
    from hybridflow import registries
    from hybridflow.plugins import load_plugins

    torch.set_num_threads(spec.threads)
    load_plugins()
    factory = registries.training_engines.get(spec.engine)
    engine: TrainingEngine = factory(role=spec.role, config=spec.engine_config, device=spec.device)
    return engine


def close_engine(engine: object) -> None:
    """Call the engine's ``close()`` when it has one (what it started that outlives it: threads, servers)."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def _iteration(batch: Batch) -> int | None:
    value = batch.meta.get("iteration")
    return None if value is None else int(value)


def _only(batch: Batch, source: Batch, **columns: str) -> Batch:
    """A batch with ``source``'s meta holding ``new_name ← batch[old_name]`` columns only."""
    return Batch({new: batch[old] for new, old in columns.items()}, meta=dict(source.meta))


class _TrainingRole(Worker):
    """Shared plumbing: build the engine, checkpoint it, report its mesh position."""

    def __init__(self, spec: RoleSpec) -> None:
        super().__init__()
        self.spec = spec
        # fault injection (tests, bench/faults.py), off unless configured: this role's own plan, from its spec
        self.faults = FaultPlan.from_json(spec.extra["faults"]) if spec.extra.get("faults") else FaultPlan()
        self.engine = _build_training_engine(spec)
        self.policy_version = 0

    def mesh_info(self) -> MeshInfo:
        return self.engine.mesh_info()

    def reusable_process(self) -> bool:
        """The training engine declared ``reusable_process`` (its info record: hybridflow.engines)."""
        return training_engine_info(self.spec.engine).reusable_process

    def close(self) -> None:
        close_engine(self.engine)

    @register(protocol="one_to_all", idempotent=True)
    def save_checkpoint(self, path: str) -> None:
        target = Path(path) / (self.spec.name or self.spec.role)
        self.engine.save_checkpoint(str(target))
        maybe_fail("checkpoint.worker_write", iteration=iteration_of_checkpoint(path), rank=self.rank,
                   plan=self.faults)
        if self.rank == 0:
            (target / "worker_state.json").write_text(json.dumps({"policy_version": self.policy_version}))

    @register(protocol="one_to_all", idempotent=True)
    def load_checkpoint(self, path: str) -> None:
        target = Path(path) / (self.spec.name or self.spec.role)
        self.engine.load_checkpoint(str(target))
        state_file = target / "worker_state.json"
        if state_file.exists():
            self.policy_version = int(json.loads(state_file.read_text())["policy_version"])

    @register(protocol="one_to_all", idempotent=True)
    def process_stats(self) -> dict[str, int]:
        """Resident bytes of this worker process and its :meth:`counters` (the weight-handover bytes so far)."""
        import psutil

        return {"rss_bytes": int(psutil.Process().memory_info().rss),
                **{name: int(value) for name, value in self.counters().items()}}

    def counters(self) -> dict[str, float]:
        """Cumulative counters sent back with every call's report (no extra round trip): the weight-handover bytes
        so far and, for the actor, the planner's lower bound so far and the latest resident weight bytes per phase."""
        handover = getattr(self, "handover", None) or {}
        return {"handover_bytes_received": float(handover.get("bytes_received", 0)),
                **{f"handover_{key}": float(handover[key]) for key in _HANDOVER_COUNTERS if key in handover}}

    def _check_version(self, batch: Batch, what: str) -> None:
        version = batch.meta.get("policy_version")
        if version is not None and version != self.policy_version:
            raise VersionMismatchError(
                f"{self.spec.name or self.spec.role}.{what} got a batch of policy_version {version} but its weights "
                f"are version {self.policy_version}; the iteration is aborted so versions never mix"
            )


#: handover keys :meth:`_TrainingRole.counters` reports (prefixed ``handover_``) next to ``bytes_received``
_HANDOVER_COUNTERS = ("bytes_sent", "lower_bound_bytes", "aliased_bytes", "planned", "weight_bytes_training",
                      "weight_bytes_generation")
