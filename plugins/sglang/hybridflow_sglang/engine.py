"""The ``sglang`` rollout engine: hybridflow's :class:`~hybridflow.engines.RolloutEngine` on SGLang's offline
``Engine`` (generate from token ids with log-probs, weight handover in memory or over a process group,
release/resume of GPU memory around training).

It owns one ``sglang.Engine`` (which itself spans ``tp_size`` GPUs); argument mapping lives in
:mod:`hybridflow_sglang.config`, output parsing in :mod:`hybridflow_sglang.outputs`, and what the trainer side of a
distributed handover runs in :mod:`hybridflow_sglang.distributed`. Stability: public.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridflow.engines import RolloutEngineConfig, SamplingParams
from hybridflow.errors import ConfigError, EngineError, VersionMismatchError
from hybridflow_sglang.api import (
    MEMORY_TAG_WEIGHTS,
    ORIGINAL_LOGPROB_ENV,
    SGLangBackend,
    SGLangEngineLike,
    check_update_result,
    load_sglang_backend,
)
from hybridflow_sglang.config import (
    SGLangOptions,
    build_sampling_params,
    build_server_args,
    device_server_args,
    parse_options,
)
from hybridflow_sglang.model_dir import prepare_model_dir
from hybridflow_sglang.outputs import build_rollout_batch, extract_prompt_ids

if TYPE_CHECKING:
    import torch

    from hybridflow.batch import Batch

__all__ = ["SGLangRolloutEngine", "WeightSpec", "build_sglang_rollout_engine", "iter_weight_buckets"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSpec:
    """Name, dtype (torch attribute name, e.g. ``"bfloat16"``) and shape of one broadcast tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def iter_weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                        bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _require_original_logprobs() -> None:
    """Make sglang return log-probs before temperature (the ``rollout_log_probs`` contract) in its subprocesses."""
    value = os.environ.setdefault(ORIGINAL_LOGPROB_ENV, "1")
    if value.strip().lower() not in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"{ORIGINAL_LOGPROB_ENV}={value!r} makes sglang return log-probs after temperature, but hybridflow's "
            f"rollout_log_probs are the policy's own log-probs; unset it (the plugin sets it to 1)."
        )


class SGLangRolloutEngine:
    """One SGLang engine behind hybridflow's rollout protocol (stability: public).

    ``backend`` defaults to the real sglang (:func:`load_sglang_backend`); tests pass a declared test double. A
    ``model.config`` without ``model.path`` (the trainer's presets) is written to a temporary HF directory first,
    which :meth:`shutdown` removes.
    """

    def __init__(self, config: RolloutEngineConfig, *, device: str = "cuda",
                 backend: SGLangBackend | None = None) -> None:
        self.config = config
        self.options: SGLangOptions = parse_options(config.extra)
        device_server_args(device)  # a device sglang cannot use fails before anything is imported or written
        self._backend = backend if backend is not None else load_sglang_backend()
        _require_original_logprobs()
        model_dir, self._model_holder = prepare_model_dir(config.model)
        self.server_args = build_server_args(config, self.options, device=device, model_path=str(model_dir))
        try:
            self._engine: SGLangEngineLike = self._backend.engine_class(**self.server_args)
        except BaseException:
            self._remove_model_dir()
            raise
        self._version = 0
        self._released: tuple[str, ...] = ()
        self._weights_stale = False
        capabilities = {"update_weights_in_memory", "log_probs"}
        if self.options.enable_memory_saver:
            capabilities.add("sleep")
        if self.options.enable_deterministic_inference:
            capabilities.add("seed")
        self.capabilities: frozenset[str] = frozenset(capabilities)

    # --- generation -------------------------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """Policy version of the weights the engine holds (0 = the weights it loaded from ``model.path``)."""
        return self._version

    @property
    def is_asleep(self) -> bool:
        return bool(self._released)

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt; rows come out prompt-major (n samples of prompt 0 first)."""
        if self._released:
            raise EngineError(f"sglang engine is asleep (released {list(self._released)}); call wake() first.")
        if self._weights_stale:
            raise EngineError(
                "sglang weights are incomplete (a weight update was started but not finished, or released weights "
                "were resumed without new contents); finish the update (update_weights / the last bucket with "
                "flush_cache=True) before generating."
            )
        if sampling.max_new_tokens > self.config.max_new_tokens:
            raise ConfigError(
                f"sampling.max_new_tokens={sampling.max_new_tokens} exceeds the engine's max_new_tokens="
                f"{self.config.max_new_tokens} (its context length is sized for it); raise the rollout config value."
            )
        if sampling.seed is not None and "seed" not in self.capabilities:
            raise ConfigError(
                "sampling.seed is set but sglang honours sampling_seed only with deterministic inference; set "
                'extra={"enable_deterministic_inference": True} on the rollout config, or leave seed unset.'
            )
        prompts = extract_prompt_ids(batch)
        if sampling.seed is not None:  # one request per sample so each gets its own derived seed
            prompts = [ids for ids in prompts for _ in range(sampling.n)]
        params = build_sampling_params(sampling, rows=len(prompts), eos_token_id=self.config.eos_token_id)
        outputs = self._engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        if isinstance(outputs, Mapping):
            outputs = [outputs]
        return build_rollout_batch(
            batch, list(outputs), samples_per_prompt=sampling.n, max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.config.pad_token_id, policy_version=self._version,
        )

    # --- weight handover --------------------------------------------------------------------------------------
    def _check_version(self, version: int) -> None:
        if version < self._version:
            raise VersionMismatchError(
                f"weight update to policy version {version} but the engine already holds version {self._version}; "
                "expected a version ≥ the current one. Versions never go backwards within a run."
            )

    def _prepare_update(self, version: int) -> None:
        self._check_version(version)
        if MEMORY_TAG_WEIGHTS in self._released:  # weights must be resident to be written into
            self._engine.resume_memory_occupation(tags=[MEMORY_TAG_WEIGHTS])
            self._released = tuple(tag for tag in self._released if tag != MEMORY_TAG_WEIGHTS)
        self._weights_stale = True  # until the last tensor has landed

    def _finish_update(self, version: int) -> None:
        self._version = version
        self._weights_stale = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load full weights named as in the HF checkpoint (tg = 1); every sglang TP rank slices its own shard.

        Tensors go through ``update_weights_from_tensor`` in buckets of ``extra.weight_bucket_bytes``; the prefix
        cache is flushed with the last bucket. If weights were released by ``sleep()``, they are resumed first.
        """
        self._prepare_update(version)
        pending: list[tuple[str, torch.Tensor]] | None = None
        for bucket in iter_weight_buckets(named_tensors, bucket_bytes=self.options.weight_bucket_bytes):
            if pending is not None:
                self._push_tensors(pending, load_format=None, flush_cache=False)
            pending = bucket
        if pending is None:
            raise EngineError("update_weights got no tensors; expected the model's named weights.")
        self._push_tensors(pending, load_format=None, flush_cache=True)
        self._finish_update(version)

    def update_weights_per_rank(self, shards: Sequence[Mapping[str, torch.Tensor]], *, version: int) -> None:
        """Load already resharded weights: ``shards[r]`` holds TP rank ``r``'s local tensors in sglang's own
        parameter names (fused ``qkv_proj`` / ``gate_up_proj``, see
        :func:`hybridflow_sglang.layout.build_sglang_layout`).

        Each rank receives only its own shard (``LocalSerializedTensor``) and copies it into the parameter of the
        same name (``load_format="direct"``); tensors should live on that rank's GPU (CUDA IPC, no copy).
        """
        tp_size = self.config.tensor_parallel_size
        if len(shards) != tp_size:
            raise EngineError(
                f"update_weights_per_rank expects one shard dict per TP rank ({tp_size}), got {len(shards)}."
            )
        names = list(shards[0])
        for rank, shard in enumerate(shards[1:], start=1):
            if list(shard) != names:
                raise EngineError(
                    f"TP rank {rank} shards name {sorted(set(shard) ^ set(names))[:4]} differently from rank 0; every "
                    "rank must hold the same parameter names in the same order."
                )
        if not names:
            raise EngineError("update_weights_per_rank got no tensors; expected sglang parameter shards.")
        self._prepare_update(version)
        named = [
            (name, self._backend.local_serialized_tensor([self._backend.serialize(shard[name]) for shard in shards]))
            for name in names
        ]
        self._push_tensors(named, load_format="direct", flush_cache=True)
        self._finish_update(version)

    def _push_tensors(self, named: list[tuple[str, Any]], *, load_format: str | None, flush_cache: bool) -> None:
        result = self._engine.update_weights_from_tensor(named_tensors=named, load_format=load_format,
                                                         flush_cache=flush_cache)
        check_update_result(result, what="update_weights_from_tensor")

    def init_weights_update_group(self, *, master_address: str, master_port: int, world_size: int,
                                  group_name: str = "hybridflow_weights", backend: str = "nccl") -> None:
        """Join the trainer's broadcast group as ranks 1…tp_size (the trainer is rank 0); blocks until it joins.

        Call concurrently with :meth:`hybridflow_sglang.distributed.SGLangWeightSender.connect`.
        """
        expected = 1 + self.config.tensor_parallel_size
        if world_size != expected:
            raise ConfigError(
                f"weight update group world_size must be 1 trainer + tp_size = {expected}, got {world_size}"
            )
        result = self._engine.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=1, world_size=world_size,
            group_name=group_name, backend=backend,
        )
        check_update_result(result, what="init_weights_update_group")

    def update_weights_from_distributed(self, specs: Sequence[WeightSpec], *, version: int,
                                        group_name: str = "hybridflow_weights", flush_cache: bool = True) -> None:
        """Receive one bucket broadcast by the trainer (rank 0) and load it; blocks until the broadcast ends.

        ``specs`` must list the tensors in the order the sender broadcasts them
        (:meth:`hybridflow_sglang.distributed.SGLangWeightSender.send_bucket`). Pass ``flush_cache=False`` for every
        bucket but the last; the version is recorded when the last bucket (``flush_cache=True``) arrives.
        """
        if not specs:
            raise EngineError("update_weights_from_distributed got no weight specs.")
        self._prepare_update(version)
        result = self._engine.update_weights_from_distributed(
            names=[spec.name for spec in specs], dtypes=[spec.dtype for spec in specs],
            shapes=[list(spec.shape) for spec in specs], group_name=group_name, flush_cache=flush_cache,
            load_format=None,
        )
        check_update_result(result, what="update_weights_from_distributed")
        if flush_cache:
            self._finish_update(version)

    def destroy_weights_update_group(self, *, group_name: str = "hybridflow_weights") -> None:
        check_update_result(self._engine.destroy_weights_update_group(group_name=group_name),
                            what="destroy_weights_update_group")

    # --- colocation -------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release ``extra.memory_tags`` (KV cache and weights by default) so training can use the GPU."""
        if "sleep" not in self.capabilities:
            raise EngineError(
                "sleep() needs sglang's memory saver: expected extra={'enable_memory_saver': True} on the rollout "
                "config (it must be set when the engine starts), got enable_memory_saver=False."
            )
        if self._released:
            raise EngineError(f"sglang engine is already asleep (released {list(self._released)}); call wake() first.")
        tags = list(self.options.memory_tags)
        self._engine.release_memory_occupation(tags=tags)
        self._released = tuple(tags)

    def wake(self) -> None:
        """Resume what ``sleep()`` released and an update has not already brought back.

        Released weights come back without their contents unless ``extra.enable_weights_cpu_backup``; generation is
        then refused until ``update_weights`` has pushed them (both sleep → update → wake and sleep → wake → update
        work).
        """
        if not self._released:
            raise EngineError("wake() called on an engine that is not asleep; call sleep() first.")
        if MEMORY_TAG_WEIGHTS in self._released and not self.options.enable_weights_cpu_backup:
            self._weights_stale = True
        self._engine.resume_memory_occupation(tags=list(self._released))
        self._released = ()

    def shutdown(self) -> None:
        """Stop sglang's scheduler and detokenizer processes (and remove a materialised model directory)."""
        try:
            self._engine.shutdown()
        finally:
            self._remove_model_dir()

    def _remove_model_dir(self) -> None:
        if self._model_holder is not None:
            self._model_holder.cleanup()
            self._model_holder = None


def build_sglang_rollout_engine(*, config: RolloutEngineConfig, device: str) -> SGLangRolloutEngine:
    """Factory registered as rollout engine ``"sglang"``: imports sglang and starts an engine on ``device``."""
    return SGLangRolloutEngine(config, device=device)
