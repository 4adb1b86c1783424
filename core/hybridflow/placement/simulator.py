"""Analytical stage times for training, inference, generation and the actor's train→generate transition.

Compute is FLOPs over peak × efficiency; communication is ring collectives over the slowest link a group crosses;
decode is bounded by weight and KV-cache bytes over memory bandwidth. It does not choose layouts (that is
:mod:`hybridflow.placement.autoparallel`) and plugins may override any stage through a :class:`CostModel`.
Stability: developer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridflow.placement.cost_model import CostModel
from hybridflow.placement.dataflow import Workload
from hybridflow.placement.models import ModelSpec
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig, estimate_transition_bytes
from hybridflow.placement.profiles import Cluster, Efficiency, InterconnectProfile

__all__ = ["Simulator"]

INFEASIBLE = math.inf


def _all_reduce_seconds(nbytes: float, ranks: int, link: InterconnectProfile, comm_efficiency: float) -> float:
    """Ring all-reduce: 2·(n−1)/n of the buffer over the link, plus 2·(n−1) latency hops."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (link.bandwidth * comm_efficiency) + 2 * (ranks - 1) * link.latency


@dataclass(kw_only=True, slots=True)
class Simulator:
    """Estimates seconds per stage for ``cluster`` and ``workload``; ``overrides`` maps a role to a CostModel."""

    cluster: Cluster
    workload: Workload
    efficiency: Efficiency = field(default_factory=Efficiency)
    overrides: Mapping[str, CostModel] = field(default_factory=dict)

    def _compute_efficiency(self, base: float, tokens_per_device: float) -> float:
        saturation = self.efficiency.saturation_tokens
        return base * tokens_per_device / (tokens_per_device + saturation) if saturation else base

    def train_seconds(self, role: str, model: ModelSpec, parallel: ParallelConfig, sequences: float) -> float:
        """Forward + backward (6·params·tokens) over every epoch, with TP, PP-bubble and DP-gradient costs."""
        override = self.overrides.get(role)
        if override is not None:
            value = override.train_seconds(model=model, parallel=parallel, workload=self.workload,
                                           cluster=self.cluster, sequences=sequences)
            if value is not None:
                return value
        w, p, d = self.workload, parallel.pipeline, parallel.data
        steps = w.ppo_epochs * w.mini_batches
        tokens = sequences * w.sequence_length * w.ppo_epochs
        tokens_per_step_device = tokens / steps / parallel.world_size
        eff = self._compute_efficiency(self.efficiency.train, tokens_per_step_device)
        compute = 6 * model.parameters * tokens / (parallel.world_size * self.cluster.device.peak_flops * eff)
        micro_batches = max(1.0, sequences / steps / (d * w.micro_batch_size))
        compute *= 1 + (p - 1) / micro_batches
        return compute + self._model_parallel_comm(model, parallel, tokens, collectives_per_layer=6,
                                                   micro_batches=micro_batches * steps) \
            + steps * self._gradient_all_reduce(model, parallel) \
            + self._sharded_sync_seconds(model, parallel, per_layer=3 * math.ceil(micro_batches) * steps)

    def infer_seconds(self, role: str, model: ModelSpec, parallel: ParallelConfig, sequences: float) -> float:
        """One forward pass (2·params·tokens) over full sequences, with TP and PP-bubble costs."""
        override = self.overrides.get(role)
        if override is not None:
            value = override.infer_seconds(model=model, parallel=parallel, workload=self.workload,
                                           cluster=self.cluster, sequences=sequences)
            if value is not None:
                return value
        w = self.workload
        tokens = sequences * w.sequence_length
        eff = self._compute_efficiency(self.efficiency.infer, tokens / parallel.world_size)
        compute = 2 * model.parameters * tokens / (parallel.world_size * self.cluster.device.peak_flops * eff)
        micro_batches = max(1.0, sequences / (parallel.data * w.micro_batch_size))
        compute *= 1 + (parallel.pipeline - 1) / micro_batches
        return compute + self._model_parallel_comm(model, parallel, tokens, collectives_per_layer=2,
                                                   micro_batches=micro_batches) \
            + self._sharded_sync_seconds(model, parallel, per_layer=math.ceil(micro_batches))

    def _sharded_sync_seconds(self, model: ModelSpec, parallel: ParallelConfig, per_layer: float) -> float:
        """Latency of fully sharded data parallelism: ``per_layer`` collectives on each of a rank's layers (plus
        one for embeddings and head), 2·(d−1) ring hops each, at ``Efficiency.sync_latency_seconds`` a hop."""
        latency = self.efficiency.sync_latency_seconds
        if latency <= 0 or parallel.data <= 1:
            return 0.0
        layers = math.ceil(model.num_layers / parallel.pipeline) + 1
        return per_layer * layers * 2 * (parallel.data - 1) * latency

    def _model_parallel_comm(self, model: ModelSpec, parallel: ParallelConfig, tokens: float,
                             collectives_per_layer: int, micro_batches: float) -> float:
        """TP all-reduces of activations in each rank's layers, plus pipeline point-to-point sends."""
        p, t, d = parallel.pipeline, parallel.tensor, parallel.data
        local_bytes = tokens / d * model.hidden_size * model.dtype_bytes
        layers = math.ceil(model.num_layers / p)
        seconds = 0.0
        if t > 1:
            link = self.cluster.link(t)
            per_layer = _all_reduce_seconds(local_bytes, t, link, self.efficiency.comm)
            seconds += collectives_per_layer * layers * per_layer
            seconds += collectives_per_layer * layers * micro_batches * 2 * (t - 1) * link.latency
        if p > 1:
            link = self.cluster.link(p, stride=t * d)
            seconds += collectives_per_layer / 2 * local_bytes / t / (link.bandwidth * self.efficiency.comm)
        return seconds

    def _gradient_all_reduce(self, model: ModelSpec, parallel: ParallelConfig) -> float:
        """One optimizer step's gradient all-reduce over the data-parallel group (TP ranks innermost)."""
        grad_bytes = model.parameters / parallel.model_parallel_size * model.dtype_bytes
        link = self.cluster.link(parallel.data, stride=parallel.tensor)
        return _all_reduce_seconds(grad_bytes, parallel.data, link, self.efficiency.comm)

    def generate_seconds(self, role: str, model: ModelSpec, parallel: ParallelConfig,
                         generation: GenerationConfig, sequences: float, kv_cache_bytes: float) -> float:
        """Prefill compute plus decode steps bounded by weight and KV bytes over memory bandwidth, plus TP traffic.

        ``kv_cache_bytes`` is the KV cache free per device; sequences that do not fit run in later waves.
        Returns ``math.inf`` if not even one sequence fits.
        """
        override = self.overrides.get(role)
        if override is not None:
            value = override.generate_seconds(model=model, parallel=parallel, generation=generation,
                                              workload=self.workload, cluster=self.cluster, sequences=sequences,
                                              kv_cache_bytes=kv_cache_bytes)
            if value is not None:
                return value
        w, dev, eff = self.workload, self.cluster.device, self.efficiency
        pg, tg = generation.pipeline, generation.tensor
        group = pg * tg
        replicas = parallel.world_size // group
        per_replica = math.ceil(sequences / replicas)
        kv_per_token = model.kv_bytes_per_token() / (pg * min(tg, model.num_kv_heads))
        concurrent = math.floor(kv_cache_bytes / (kv_per_token * w.sequence_length)) if kv_cache_bytes > 0 else 0
        if concurrent < 1:
            return INFEASIBLE
        waves = math.ceil(per_replica / concurrent)
        batch = math.ceil(per_replica / waves)
        prompt_tokens = per_replica * w.prompt_length
        prefill_eff = self._compute_efficiency(eff.prefill, prompt_tokens / group)
        prefill = 2 * model.parameters * prompt_tokens / (group * dev.peak_flops * prefill_eff)
        tp_link = self.cluster.link(tg)
        layers = math.ceil(model.num_layers / pg)
        prompt_bytes = prompt_tokens * model.hidden_size * model.dtype_bytes
        prefill += 2 * layers * pg * _all_reduce_seconds(prompt_bytes, tg, tp_link, eff.comm)
        context = w.prompt_length + w.response_length / 2
        bandwidth = dev.memory_bandwidth * eff.decode_bandwidth
        memory_time = (model.weight_bytes / group + batch * context * kv_per_token) / bandwidth
        compute_time = 2 * model.parameters * batch / (group * dev.peak_flops * eff.infer)
        step_bytes = batch * model.hidden_size * model.dtype_bytes
        tp_time = 2 * layers * _all_reduce_seconds(step_bytes, tg, tp_link, eff.comm)
        pp_link = self.cluster.link(pg, stride=tg)
        step = pg * (max(memory_time, compute_time) + tp_time) + (pg - 1) * pp_link.latency
        return prefill + waves * w.response_length * step

    def transition_seconds(self, model: ModelSpec, parallel: ParallelConfig, generation: GenerationConfig) -> float:
        """Actor training → generation reshard: per-rank bytes over the model-parallel group's link, plus overhead."""
        nbytes = estimate_transition_bytes(model.weight_bytes, parallel.pipeline, parallel.tensor, parallel.data,
                                           generation.pipeline, generation.tensor)
        link = self.cluster.link(parallel.model_parallel_size)
        # fully sharded weights are gathered one tensor at a time: ~9 per Llama-style layer (q, k, v, o, gate, up,
        # down, two norms)
        return nbytes / (link.bandwidth * self.efficiency.comm) + self.efficiency.transition_overhead_seconds \
            + self._sharded_sync_seconds(model, parallel, per_layer=9)
