"""Worker classes for the four kinds of model role (an algorithm may declare several roles of one kind); each
method declares its transfer protocol with ``@register``.

A worker owns engines built from the registries inside its process; it knows nothing about which plugin supplied
them. Training-engine methods use protocol ``mesh`` (data to data-parallel groups, replicated inside tensor and
pipeline groups, collected from the ranks the engine marks). The actor worker is the hybrid engine: it trains and
generates on the same ranks. With ``rollout.tensor_parallel_size = tg`` it draws the generation layout (pg = 1, tg)
inside the training mesh (stride grouping: micro-DP groups of the training shard group), gives the rollout engine
its tensor groups, hands the weights over with the training engine's reshard (this rank's generation shards) before
each generation, and ``generate`` uses protocol ``generation_mesh``: one shard of the prompts per generation
replica, the same to every rank of a tensor group, collected from tensor rank 0 (at tg = 1: ``dp_compute``).
The spec and the plumbing every role shares (engine, checkpoints, counters) are :mod:`hybridflow.workers.base`'.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from hybridflow.adapter_sync import HandsOverAdapters, LoadsAdapters
from hybridflow.batch import Batch
from hybridflow.controller import register
from hybridflow.engines import (
    BindsGenerationWeights,
    GeneratesTensorParallel,
    HoldsWeights,
    MeshInfo,
    ParksTrainingWeights,
    ReportsHandover,
    ReportsParameterShapes,
    ReshardsGenerationWeights,
    RolloutEngine,
    SamplingParams,
    rollout_engine_info,
    training_engine_info,
    verify_declared_capabilities,
)
from hybridflow.errors import ConfigError, EngineContractError, EngineError, LayoutError, VersionMismatchError
from hybridflow.reliability.faults import maybe_fail
from hybridflow.workers.base import RANK_TOKENS_METRIC, RoleSpec, _iteration, _only, _TrainingRole, close_engine

if TYPE_CHECKING:
    from hybridflow.agent.code_agent import CodeAgentRollout
    from hybridflow.agent.env_rollout import EnvRollout
    from hybridflow.agent.worker import AgentRollout
    from hybridflow.resharding import GenerationLayout

__all__ = ["RoleSpec", "ActorRolloutWorker", "CriticWorker", "ReferenceWorker", "RewardModelWorker"]


class ActorRolloutWorker(_TrainingRole):
    """The hybrid engine: FSDP/Megatron training and rollout generation on the same ranks."""

    def __init__(self, spec: RoleSpec) -> None:
        if spec.rollout_engine is None or spec.rollout_config is None or spec.sampling is None:
            raise EngineError("the actor role needs rollout_engine, rollout_config and sampling in its RoleSpec")
        tensor = int(spec.rollout_config.tensor_parallel_size)
        if tensor > 1:  # the training engine may lay its shards out for that layout (fsdp: row weights on dim 1)
            spec = replace(spec, engine_config=replace(spec.engine_config, generation_tensor_parallel_size=tensor))
        super().__init__(spec)
        assert spec.rollout_engine is not None and spec.rollout_config is not None and spec.sampling is not None
        from hybridflow import registries

        # what each engine declared at registration: decided once here, never probed per call
        self.training_info = training_engine_info(spec.engine)
        verify_declared_capabilities(self.engine, self.training_info, spec.engine)
        self.rollout_info = rollout_engine_info(spec.rollout_engine)
        self.generation_layout = self._build_generation_layout(tensor)
        rollout_config = spec.rollout_config
        if self.generation_layout is not None:
            layout = self.generation_layout
            # tensor groups in tensor-rank order; every rank creates every group, in this order
            groups = tuple(tuple(sorted(group, key=lambda r: layout.coords(r).tensor))
                           for group in layout.tensor_groups())
            rollout_config = replace(rollout_config, tensor_groups=groups)
        factory = registries.rollout_engines.get(spec.rollout_engine)
        self.rollout: RolloutEngine = factory(config=rollout_config, device=spec.device)
        verify_declared_capabilities(self.rollout, self.rollout_info, spec.rollout_engine)
        if self.generation_layout is not None:
            self._check_tensor_rank(self.generation_layout.coords(self.rank).tensor)
        self._bind = "binds_generation_weights" in self.rollout_info.capabilities
        # a training engine that parks its shards in the bound generation shards (fsdp): one copy while generating
        self._parks = "parks_training_weights" in self.training_info.capabilities
        self._park = self._bind and self._parks
        self.handover: dict[str, float] = {"seconds": 0.0, "bytes_received": 0, "count": 0}
        self._asleep = False
        #: adapter-only weight sync (hybridflow.adapter_sync): wrapped module → alpha / rank, empty when off (no LoRA,
        #: an engine without it, tg > 1, actor.extra.lora_sync=merged); None until the first handover asks
        self._adapter_scales: dict[str, float] | None = None
        self._base_loaded = False  # the rollout engine holds the LoRA actor's base weights (adapter sync)
        #: inside a streamed step (trainer.stream_mini_batches): chunks taken, the final one not yet; the weights
        #: are then none of the policy versions
        self._mid_step = False
        self._agent: AgentRollout | None = None  # rollout.multi_turn's agent loop, built on first use
        self._code_agent: CodeAgentRollout | None = None  # rollout.agent's endpoint and entry, built on first use
        self._env: EnvRollout | None = None  # rollout.env's server (or url) and episode loop, built on first use
        # the trainer always passes trainer.seed; an engine without the "seed" capability samples unseeded instead
        self._seeded = spec.sampling.seed is not None and "seed" in self.rollout.capabilities
        if spec.sampling.seed is not None and not self._seeded and self.rank == 0:
            warnings.warn(f'rollout engine "{spec.rollout_engine}" cannot seed its sampling (no "seed" capability), so '
                          "generation does not follow trainer.seed; see the engine's docs for how to turn it on",
                          stacklevel=1)

    def _build_generation_layout(self, tensor: int) -> GenerationLayout | None:
        """The generation mesh (pg = 1, tg = ``tensor``) inside the training engine's mesh; None at tg = 1."""
        if tensor == 1:
            return None
        from hybridflow.resharding import GenerationLayout

        if "reshards_generation_weights" not in self.training_info.capabilities:  # config_checks refuses it first
            raise ConfigError(
                f'rollout.tensor_parallel_size={tensor} needs a training engine with capability '
                f'"reshards_generation_weights"; "{self.spec.engine}" declares '
                f"{sorted(self.training_info.capabilities)}. "
                "Set rollout.tensor_parallel_size=1 or use a training engine that does (fsdp, megatron, deepspeed)")
        training = cast(ReshardsGenerationWeights, self.engine).parallel_layout()
        try:
            return GenerationLayout(tensor=tensor, training=training)
        except LayoutError as exc:
            raise ConfigError(f"rollout.tensor_parallel_size={tensor} does not fit the actor's training mesh "
                              f"{training}: {exc}") from exc

    def _check_tensor_rank(self, expected: int) -> None:
        """The rollout engine must generate in the actor's processes as tensor rank ``expected`` of its group."""
        if "generates_tensor_parallel" not in self.rollout_info.capabilities:  # config_checks refuses it first
            raise ConfigError(
                f'rollout.tensor_parallel_size={self.rollout_tensor_parallel_size} needs a rollout engine with '
                f'capability "generates_tensor_parallel"; "{self.spec.rollout_engine}" declares '
                f"{sorted(self.rollout_info.capabilities)}. Set rollout.tensor_parallel_size=1 or use an engine that "
                "does (hf, vllm)")
        reported = cast(GeneratesTensorParallel, self.rollout).tensor_rank
        if reported is None or int(reported) != expected:
            raise EngineContractError(
                f'rollout engine "{self.spec.rollout_engine}" reports tensor rank {reported} on rank {self.rank}; the '
                f"generation layout gives it tensor rank {expected} (RolloutEngineConfig.tensor_groups order)")

    @property
    def rollout_tensor_parallel_size(self) -> int:
        """The generation tensor-parallel size tg (1 without a generation layout)."""
        return 1 if self.generation_layout is None else self.generation_layout.tensor

    @property
    def generation_replica(self) -> int:
        """This rank's generation data-parallel index (its own rank at tg = 1)."""
        if self.generation_layout is None:
            return self.rank
        return self.generation_layout.coords(self.rank).data

    def mesh_info(self) -> MeshInfo:
        """The training engine's mesh position, with this rank's generation position at tg > 1."""
        info = self.engine.mesh_info()
        layout = self.generation_layout
        if layout is None:
            return info
        coords = layout.coords(self.rank)
        return replace(info, generation=MeshInfo(dp_rank=coords.data, dp_size=layout.data,
                                                 is_collect=coords.tensor == 0 and coords.pipeline == 0))

    def _resident_weight_bytes(self, *, with_rollout: bool) -> int | None:
        """Bytes of the distinct storages behind the training weights (and the rollout engine's), None when an engine
        exposes no module to count."""
        from hybridflow.resharding import count_storage_bytes

        if "holds_weights" not in self.training_info.capabilities:
            return None
        tensors = cast(HoldsWeights, self.engine).weight_tensors()
        if with_rollout:
            if "holds_weights" not in self.rollout_info.capabilities:
                return None
            tensors = [*tensors, *cast(HoldsWeights, self.rollout).weight_tensors()]
        return count_storage_bytes(tensors)

    def _record_resident(self, phase: str) -> None:
        resident = self._resident_weight_bytes(with_rollout=True)
        if resident is not None:
            self.handover[f"weight_bytes_{phase}"] = resident

    def _sync_weights(self, iteration: int | None = None) -> None:
        """Reshard the training weights into the rollout engine if it holds an older version."""
        # the same version already loaded is reused, unless the last handover parked training storage in bound
        # shards: end_generation took that storage back, so the bound tensors are gone and must be handed over again
        adapters = self._adapter_sync()
        if (self.rollout.weights_version == self.policy_version and self.handover["count"] and not self._asleep
                and (adapters or not self._park)):
            return
        start = time.perf_counter()
        if self._asleep:  # only what this worker put to sleep is woken (engines may refuse waking an awake engine)
            self.rollout.wake()
            self._base_loaded = False
        maybe_fail("actor.handover", iteration=iteration, rank=self.rank, plan=self.faults)
        target = self.rollout_info.weights_target
        layout = self.generation_layout
        if adapters:  # the base once (copied: the engine keeps it across steps), then the factors alone
            self._sync_adapters(target, start)
            return
        if layout is not None:  # tg > 1: the reshards_generation_weights capability was checked at start
            weights = cast(ReshardsGenerationWeights, self.engine).generation_weights(
                target=target, tensor_parallel_size=layout.tensor, park=self._park)
        elif self._park:
            weights = cast(ParksTrainingWeights, self.engine).generation_weights(target=target, park=True)
        else:
            weights = self.engine.generation_weights(target=target)
        if self._bind:  # the handover's shards become the engine's weights: no second copy
            cast(BindsGenerationWeights, self.rollout).update_weights(weights, version=self.policy_version, bind=True)
        else:
            self.rollout.update_weights(weights, version=self.policy_version)
        self._add_seconds(time.perf_counter() - start)
        self._count_handover()
        self.handover["count"] += 1
        self._asleep = False

    def _adapter_sync(self) -> bool:
        """Whether this actor syncs LoRA adapters alone (:mod:`hybridflow.adapter_sync`): both engines declare it
        (``hands_over_adapters``, ``loads_adapters``), generation runs at tg = 1 and the training engine reports
        adapters to hand over."""
        if self._adapter_scales is None:
            able = ("hands_over_adapters" in self.training_info.capabilities
                    and "loads_adapters" in self.rollout_info.capabilities and self.generation_layout is None)
            self._adapter_scales = cast(HandsOverAdapters, self.engine).adapter_scales() if able else {}
        return bool(self._adapter_scales)

    def _sync_adapters(self, target: str, start: float) -> None:
        """Adapter-only sync: the base weights when the rollout engine lacks them, then every LoRA factor; both
        handovers' bytes counted, the rollout engine's weights_version set to the policy version."""
        engine, rollout = cast(HandsOverAdapters, self.engine), cast(LoadsAdapters, self.rollout)
        assert self._adapter_scales is not None
        if not self._base_loaded:
            self.rollout.update_weights(engine.generation_base_weights(target=target), version=self.policy_version)
            self._count_handover()
            self._base_loaded = True
        rollout.update_adapters(engine.generation_adapters(), scales=self._adapter_scales, version=self.policy_version)
        self._add_seconds(time.perf_counter() - start)
        self._count_handover()
        self.handover["adapter_syncs"] = self.handover.get("adapter_syncs", 0) + 1
        self.handover["count"] += 1
        self._asleep = False

    def _add_seconds(self, seconds: float) -> None:
        """A sync's wall seconds into the counters: the total and the first sync's alone (with adapter sync the
        first moves the base, so later syncs' mean is (total - first) / (count - 1))."""
        self.handover["seconds"] += seconds
        if not self.handover["count"]:
            self.handover["seconds_first"] = seconds

    def _count_handover(self) -> None:
        """Add the training engine's last handover stats to the cumulative counters (the ledger's handover edge)."""
        stats = (cast(ReportsHandover, self.engine).last_handover_stats
                 if "reports_handover" in self.training_info.capabilities else None)
        if stats is not None:
            self.handover["bytes_received"] += int(stats.bytes_received)
            lower_bound = stats.lower_bound_bytes
            self.handover["planned"] = float(lower_bound is not None and stats.path == "reshard")
            if self.handover["planned"]:
                self.handover["lower_bound_bytes"] = self.handover.get("lower_bound_bytes", 0) + int(lower_bound or 0)
                self.handover["bytes_sent"] = self.handover.get("bytes_sent", 0) + int(stats.bytes_sent or 0)
                self.handover["aliased_bytes"] = float(stats.aliased_bytes)
        else:
            self.handover["planned"] = 0.0

    @register(protocol="generation_mesh", blocking=False, idempotent=True)
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        try:
            return self._generate(prompts, greedy)
        finally:  # parked training shards come home (after the rollout engine slept: their buffers then go)
            if self._parks:
                cast(ParksTrainingWeights, self.engine).end_generation()

    def _generate(self, prompts: Batch, greedy: bool) -> Batch:
        self._refuse_mid_step("generate")
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
            # (per generation replica: every rank of a tensor group samples alike)
            sampling = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                                      seed=sampling.seed + 1000 * iteration + self.generation_replica)
        if self.spec.extra.get("agent"):  # rollout.agent: the user's agents call this rank's endpoint
            out = self._code_agent_rollout().generate(prompts, sampling, greedy=greedy)
        elif self.spec.extra.get("env"):  # rollout.env: episodes against an environment server
            out = self._env_rollout().generate(prompts, sampling)
        elif self.spec.extra.get("multi_turn", {}).get("enable"):  # rollout.multi_turn: its own code path
            out = self._agent_rollout().generate(prompts, sampling)
        else:
            out = self.rollout.generate(prompts, sampling)
        self._record_resident("generation")
        maybe_fail("actor.generate", iteration=_iteration(prompts), rank=self.rank, plan=self.faults)
        if out.meta.get("policy_version") != self.policy_version:
            raise VersionMismatchError(
                f"rollout engine produced policy_version {out.meta.get('policy_version')} but the actor weights are "
                f"version {self.policy_version}: the weight handover did not complete"
            )
        if "sleep" in self.rollout.capabilities and not self._adapter_sync():
            # free the generation weights (and KV cache) so training runs with only its shards resident (not with
            # adapter sync: the rollout engine keeps the base, so later syncs move only the adapters)
            self.rollout.sleep()
            self._asleep = True
        return out

    def reusable_process(self) -> bool:
        """Both engines declared ``reusable_process`` (their info records)."""
        return super().reusable_process() and self.rollout_info.reusable_process

    def close(self) -> None:
        """Stop rollout.agent's endpoint (a server thread), then the engines."""
        if self._code_agent is not None:
            self._code_agent.close()
        if self._env is not None:
            self._env.close()
        close_engine(self.rollout)
        super().close()

    def _agent_rollout(self) -> AgentRollout:
        """The multi-turn agent loop over this worker's rollout engine (hybridflow.agent.worker), built once."""
        if self._agent is None:
            from hybridflow.agent.worker import AgentRollout

            assert self.spec.rollout_config is not None
            self._agent = AgentRollout(self.rollout, self.spec.rollout_config, self.spec.extra["multi_turn"])
        return self._agent

    def _env_rollout(self) -> EnvRollout:
        """rollout.env's episode loop over this worker's rollout engine (hybridflow.agent.env_rollout), built once;
        an entry's server starts with the first generate."""
        if self._env is None:
            from hybridflow.agent.env_rollout import EnvRollout

            assert self.spec.rollout_config is not None
            self._env = EnvRollout(self.rollout, self.spec.rollout_config, self.spec.extra["env"])
        return self._env

    def _code_agent_rollout(self) -> CodeAgentRollout:
        """rollout.agent's OpenAI endpoint over this worker's rollout engine and the user's agent entry
        (hybridflow.agent.code_agent), built once; the endpoint starts with the first generate."""
        if self._code_agent is None:
            from hybridflow.agent.code_agent import CodeAgentRollout

            assert self.spec.rollout_config is not None and self.spec.sampling is not None
            self._code_agent = CodeAgentRollout(self.rollout, self.spec.rollout_config, self.spec.extra["agent"],
                                                max_new_tokens=self.spec.sampling.max_new_tokens)
        return self._code_agent

    @register(protocol="mesh", blocking=False, idempotent=True)
    def compute_log_probs(self, batch: Batch) -> Batch:
        self._check_version(batch, "compute_log_probs")
        self._refuse_mid_step("compute_log_probs")
        maybe_fail("actor.log_probs", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return _only(self.engine.compute_log_probs(batch), batch, old_log_probs="log_probs")

    @register(protocol="mesh_balanced", blocking=True, idempotent=False)
    def update_policy(self, batch: Batch) -> dict[str, float]:
        self._check_version(batch, "update_policy")
        metrics: dict[str, float] = {}
        for _ in range(self.spec.epochs):
            metrics = self.engine.train_step(batch, loss_fn=self.spec.loss, mini_batch_size=self.spec.mini_batch_size)
            # weights already stepped
            maybe_fail("actor.update", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return self._next_version(_with_rank_tokens(metrics, batch))

    def _next_version(self, metrics: dict[str, float]) -> dict[str, float]:
        """An update's end: the policy version moves on (reported in ``metrics``) and resident bytes are recorded."""
        self.policy_version += 1
        metrics["actor/policy_version"] = float(self.policy_version)
        self._record_resident("training")
        return metrics

    @register(protocol="mesh_balanced", blocking=True, idempotent=False)
    def update_policy_chunk(self, batch: Batch, final: bool) -> dict[str, float]:
        """One chunk of a streamed step (``trainer.stream_mini_batches``, docs/guide/async.md): its optimizer step(s)
        now; the policy version moves at the ``final`` chunk only, so a step is one version however it arrives."""
        self._check_version(batch, "update_policy_chunk")
        metrics = _with_rank_tokens(
            self.engine.train_step(batch, loss_fn=self.spec.loss, mini_batch_size=self.spec.mini_batch_size), batch)
        maybe_fail("actor.update", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        self._mid_step = not final
        return self._next_version(metrics) if final else metrics

    def _refuse_mid_step(self, what: str) -> None:
        if self._mid_step:
            raise VersionMismatchError(
                f"actor.{what} inside a streamed step: the weights have taken some of step {self.policy_version}'s "
                "chunks, not all, and are no policy version; call it before the first chunk or after the final one")

    @register(protocol="one_to_all", idempotent=True)
    def handover_stats(self) -> dict[str, float]:
        return dict(self.handover)

    @register(protocol="one_to_all", idempotent=True)
    def rollout_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The rollout engine's parameters as this rank holds them (its ``parameter_shapes()``: at tg > 1 this
        rank's tensor-parallel partition), for checking what generation keeps resident."""
        if "reports_parameter_shapes" not in self.rollout_info.capabilities:
            raise ConfigError(f'rollout engine "{self.spec.rollout_engine}" does not declare capability '
                              '"reports_parameter_shapes"; expected an engine that does (vllm)')
        return dict(cast(ReportsParameterShapes, self.rollout).parameter_shapes())

    @register(protocol="one_to_all", idempotent=True)
    def export_hf(self, path: str) -> None:
        self.engine.export_hf(path)

    @register(protocol="one_to_all", idempotent=True)
    def load_checkpoint(self, path: str) -> None:
        super().load_checkpoint(path)
        self.handover["count"] = 0  # force a fresh handover of the restored weights
        self._mid_step = False  # restored to a policy version


class CriticWorker(_TrainingRole):
    @register(protocol="mesh", blocking=False, idempotent=True)
    def compute_values(self, batch: Batch) -> Batch:
        output = _only(self.engine.compute_values(batch), batch, **{self.spec.output_key or "values": "values"})
        maybe_fail("critic.values", iteration=_iteration(batch), rank=self.rank, plan=self.faults)
        return output

    @register(protocol="mesh_balanced", blocking=True, idempotent=False)
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


def _with_rank_tokens(metrics: dict[str, float], batch: Batch) -> dict[str, float]:
    """The update's metrics with the tokens this rank trained (``global_seqlen/...`` once the driver combines them)."""
    if "attention_mask" in batch:
        metrics[RANK_TOKENS_METRIC] = float(batch["attention_mask"].sum())
    return metrics
