"""Worker classes for the four kinds of model role (an algorithm may declare several roles of one kind); each
method declares its transfer protocol with ``@register``.

A worker owns engines built from the registries inside its process; it knows nothing about which plugin supplied
them. Training-engine methods use protocol ``mesh`` (data to data-parallel groups, replicated inside tensor and
pipeline groups, collected from the ranks the engine marks); ``generate`` uses ``dp_compute`` because every rank is
its own generation replica (tg = 1). The actor worker is the hybrid engine: it trains and generates on the same
ranks and hands its weights from the training layout to the rollout engine in place before each generation.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Worker, register
from hybridflow.engines import (
    MeshInfo,
    RolloutEngine,
    RolloutEngineConfig,
    SamplingParams,
    TrainingEngine,
    TrainingEngineConfig,
)
from hybridflow.errors import EngineError, VersionMismatchError
from hybridflow.reliability.faults import FaultPlan, iteration_of_checkpoint, maybe_fail

if TYPE_CHECKING:
    from hybridflow.agent.worker import AgentRollout

__all__ = ["RoleSpec", "ActorRolloutWorker", "CriticWorker", "ReferenceWorker", "RewardModelWorker"]


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
        """Cumulative counters sent back with every call's report (no extra round trip)."""
        handover = getattr(self, "handover", None) or {}
        return {"handover_bytes_received": float(handover.get("bytes_received", 0))}

    def _check_version(self, batch: Batch, what: str) -> None:
        version = batch.meta.get("policy_version")
        if version is not None and version != self.policy_version:
            raise VersionMismatchError(
                f"{self.spec.name or self.spec.role}.{what} got a batch of policy_version {version} but its weights "
                f"are version {self.policy_version}; the iteration is aborted so versions never mix"
            )


class ActorRolloutWorker(_TrainingRole):
    """The hybrid engine: FSDP/Megatron training and rollout generation on the same ranks."""

    def __init__(self, spec: RoleSpec) -> None:
        super().__init__(spec)
        if spec.rollout_engine is None or spec.rollout_config is None or spec.sampling is None:
            raise EngineError("the actor role needs rollout_engine, rollout_config and sampling in its RoleSpec")
        from hybridflow import registries

        factory = registries.rollout_engines.get(spec.rollout_engine)
        self.rollout: RolloutEngine = factory(config=spec.rollout_config, device=spec.device)
        self.handover: dict[str, float] = {"seconds": 0.0, "bytes_received": 0, "count": 0}
        self._asleep = False
        self._agent: AgentRollout | None = None  # rollout.multi_turn's agent loop, built on first use
        # the trainer always passes trainer.seed; an engine without the "seed" capability samples unseeded instead
        self._seeded = spec.sampling.seed is not None and "seed" in self.rollout.capabilities
        if spec.sampling.seed is not None and not self._seeded and self.rank == 0:
            warnings.warn(f'rollout engine "{spec.rollout_engine}" cannot seed its sampling (no "seed" capability), so '
                          "generation does not follow trainer.seed; see the engine's docs for how to turn it on",
                          stacklevel=1)

    def _sync_weights(self, iteration: int | None = None) -> None:
        """Reshard the training weights into the rollout engine if it holds an older version."""
        if self.rollout.weights_version == self.policy_version and self.handover["count"] and not self._asleep:
            return
        start = time.perf_counter()
        if self._asleep:  # only what this worker put to sleep is woken (engines may refuse waking an awake engine)
            self.rollout.wake()
        maybe_fail("actor.handover", iteration=iteration, rank=self.rank, plan=self.faults)
        target = getattr(self.rollout, "weights_target", "hf")
        self.rollout.update_weights(self.engine.generation_weights(target=target), version=self.policy_version)
        stats = getattr(self.engine, "last_handover_stats", None)
        self.handover["seconds"] += time.perf_counter() - start
        self.handover["bytes_received"] += int(getattr(stats, "bytes_received", 0) or 0)
        self.handover["count"] += 1
        self._asleep = False

    @register(protocol="dp_compute", blocking=False, idempotent=True)
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        self._sync_weights(_iteration(prompts))
        sampling = self.spec.sampling
        assert sampling is not None
        if not self._seeded:
            sampling = replace(sampling, seed=None)
        if greedy:
            sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=sampling.max_new_tokens,
                                      seed=sampling.seed)
        elif sampling.seed is not None:
            # a different but reproducible stream per rank and iteration
            iteration = int(prompts.meta.get("iteration") or 0)
            sampling = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                                      seed=sampling.seed + 1000 * iteration + self.rank)
        if self.spec.extra.get("multi_turn", {}).get("enable"):  # rollout.multi_turn: its own code path
            out = self._agent_rollout().generate(prompts, sampling)
        else:
            out = self.rollout.generate(prompts, sampling)
        maybe_fail("actor.generate", iteration=_iteration(prompts), rank=self.rank, plan=self.faults)
        if out.meta.get("policy_version") != self.policy_version:
            raise VersionMismatchError(
                f"rollout engine produced policy_version {out.meta.get('policy_version')} but the actor weights are "
                f"version {self.policy_version}: the weight handover did not complete"
            )
        if "sleep" in self.rollout.capabilities:
            # free the generation weights (and KV cache) so training runs with only its shards resident
            self.rollout.sleep()
            self._asleep = True
        return out

    def _agent_rollout(self) -> AgentRollout:
        """The multi-turn agent loop over this worker's rollout engine (hybridflow.agent.worker), built once."""
        if self._agent is None:
            from hybridflow.agent.worker import AgentRollout

            assert self.spec.rollout_config is not None
            self._agent = AgentRollout(self.rollout, self.spec.rollout_config, self.spec.extra["multi_turn"])
        return self._agent

    @register(protocol="mesh", blocking=False, idempotent=True)
    def compute_log_probs(self, batch: Batch) -> Batch:
        self._check_version(batch, "compute_log_probs")
        maybe_fail("actor.log_probs", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return _only(self.engine.compute_log_probs(batch), batch, old_log_probs="log_probs")

    @register(protocol="mesh", blocking=True, idempotent=False)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        self._check_version(batch, "update_policy")
        metrics: dict[str, float] = {}
        for _ in range(self.spec.epochs):
            metrics = self.engine.train_step(batch, loss_fn=self.spec.loss, mini_batch_size=self.spec.mini_batch_size)
            # weights already stepped
            maybe_fail("actor.update", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        self.policy_version += 1
        metrics["actor/policy_version"] = float(self.policy_version)
        return metrics

    @register(protocol="one_to_all", idempotent=True)
    def handover_stats(self) -> dict[str, float]:
        return dict(self.handover)

    @register(protocol="one_to_all", idempotent=True)
    def export_hf(self, path: str) -> None:
        self.engine.export_hf(path)

    @register(protocol="one_to_all", idempotent=True)
    def load_checkpoint(self, path: str) -> None:
        super().load_checkpoint(path)
        self.handover["count"] = 0  # force a fresh handover of the restored weights


class CriticWorker(_TrainingRole):
    @register(protocol="mesh", blocking=False, idempotent=True)
    def compute_values(self, batch: Batch) -> Batch:
        output = _only(self.engine.compute_values(batch), batch, **{self.spec.output_key or "values": "values"})
        maybe_fail("critic.values", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return output

    @register(protocol="mesh", blocking=True, idempotent=False)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for _ in range(self.spec.epochs):
            metrics = self.engine.train_step(batch, loss_fn=self.spec.loss, mini_batch_size=self.spec.mini_batch_size)
            # weights already stepped
            maybe_fail("critic.update", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return metrics


class ReferenceWorker(_TrainingRole):
    @register(protocol="mesh", blocking=False, idempotent=True)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        output = _only(self.engine.compute_log_probs(batch), batch, ref_log_probs="log_probs")
        maybe_fail("reference.log_probs", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return output


class RewardModelWorker(_TrainingRole):
    @register(protocol="mesh", blocking=False, idempotent=True)
    def compute_scores(self, batch: Batch) -> Batch:
        output = _only(self.engine.compute_scores(batch), batch, **{self.spec.output_key or "scores": "scores"})
        maybe_fail("reward_model.scores", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return output


def worker_environment() -> dict[str, str]:
    """Environment every worker process gets (one torch thread: more only slow a 2-core box)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
