"""The ``vllm`` rollout engine: vLLM's public ``LLM`` API behind :class:`hybridflow.engines.RolloutEngine`.

Token ids in (no tokenizer in the engine), response ids, masks and per-token log-probs out; weights arrive in memory
through a worker extension. Resharding the trainer's weights into Hugging Face names is left to the training engine
and the reshard planner; scheduling generate/update/sleep is left to the driver. Stability: public.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from hybridflow.batch import Batch
from hybridflow.engines import RolloutEngineConfig, SamplingParams, TokenCompletion
from hybridflow.errors import ConfigError, EngineError
from hybridflow_vllm.columns import build_rollout_columns, prompt_token_lists
from hybridflow_vllm.launcher import (
    check_external_launcher,
    external_launcher_identity,
    release_vllm_groups,
    restore_random_states,
    save_random_states,
    shared_memory_identity,
    unlink_shared_memory,
)
from hybridflow_vllm.layout import check_vocabulary_split, tensor_parallel_shard_shapes
from hybridflow_vllm.model_dir import prepare_model_dir, read_checkpoint_shapes
from hybridflow_vllm.options import ENGINE_ENVIRONMENT, VllmOptions, WeightUpdateStats
from hybridflow_vllm.worker_extension import WORKER_EXTENSION

if TYPE_CHECKING:
    import tempfile

__all__ = ["VllmOptions", "WeightUpdateStats", "VllmRolloutEngine"]


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


class VllmRolloutEngine:
    """One in-process vLLM engine on one rank (``tensor_parallel_size`` workers inside it), or, given
    ``RolloutEngineConfig.tensor_groups`` at ``tensor_parallel_size > 1``, this rank's tensor-parallel worker of an
    engine that spans the caller's ranks (vLLM's ``external_launcher``; the hybrid engine's path). Stability: public.

    ``capabilities`` holds ``update_weights_in_memory``, ``log_probs`` and ``seed``, plus ``sleep`` where the
    platform supports vLLM's sleep mode (CUDA/ROCm/XPU; not CPU, where ``sleep``/``wake`` only mark the engine
    unusable/usable and free nothing).
    """

    #: naming of the weights ``update_weights`` expects (``TrainingEngine.generation_weights(target=...)``): the
    #: unfused Hugging Face names; vLLM fuses q/k/v and gate/up itself while loading
    weights_target: str = "hf"

    def __init__(self, *, config: RolloutEngineConfig, device: str = "cpu") -> None:
        self.config = config
        extra = dict(config.extra)
        #: the hybrid engine's tensor groups (``ActorRolloutWorker``): generate tensor-parallel across the caller's
        #: own processes with vLLM's ``external_launcher`` executor, each rank loading only its generation shards
        self.tensor_groups: list[list[int]] | None = (
            [list(group) for group in config.tensor_groups] if config.tensor_groups is not None else None)
        self.options = VllmOptions.from_extra(extra)
        self.device = device
        self.max_model_len = config.max_prompt_length + config.max_new_tokens
        self.last_update: WeightUpdateStats | None = None
        #: names this engine's /dev/shm segments (external launcher only; their names are unlinked once started)
        self.shared_memory_identity: str | None = None
        self._version = 0
        self._asleep = False
        for key, value in ENGINE_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        self._broken: str | None = None
        if self.tensor_groups is not None:
            check_external_launcher(self.config.tensor_parallel_size, self.tensor_groups, self.options.llm_kwargs)
        self.model_dir, self._model_holder = prepare_model_dir(config.model)
        self.weight_shapes = read_checkpoint_shapes(self.model_dir)
        if self.weights_sharded:
            check_vocabulary_split(self.weight_shapes)
            self.weight_shapes = tensor_parallel_shard_shapes(self.weight_shapes, config.tensor_parallel_size)
        try:
            self._llm = self._start()
        except BaseException:
            self._cleanup_model_dir()
            raise
        sleep = {"sleep"} if self._sleep_enabled else set()
        self.capabilities: frozenset[str] = frozenset(
            {"update_weights_in_memory", "log_probs", "seed", "continue_from_tokens"} | sleep)

    @property
    def weights_sharded(self) -> bool:
        """Whether ``update_weights`` takes this rank's tensor-parallel shards (the hybrid engine's generation layout
        at ``tensor_parallel_size > 1``) instead of full tensors."""
        return self.tensor_groups is not None and self.config.tensor_parallel_size > 1

    @property
    def tensor_rank(self) -> int | None:
        """This process's vLLM tensor-parallel rank when it generates as one rank of the caller's tensor group
        (``RolloutEngineConfig.tensor_groups``), else None (tp = 1, or vLLM's own workers)."""
        if not self.weights_sharded or getattr(self, "_llm", None) is None:
            return None
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def _start(self) -> Any:
        from vllm import LLM

        self._sleep_enabled = _sleep_mode_available()
        options = self.options
        kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "skip_tokenizer_init": True,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "dtype": self.config.model.dtype,
            "seed": self.config.seed,
            "max_model_len": self.max_model_len,
            "enforce_eager": options.enforce_eager,
            "kv_cache_memory_bytes": options.kv_cache_memory_bytes,
            "enable_prefix_caching": options.enable_prefix_caching,
            "enable_sleep_mode": self._sleep_enabled,
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if self.tensor_groups is not None and self.config.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"  # the caller's ranks are vLLM's TP workers
        kwargs.update(options.llm_kwargs)
        set_num_threads = torch.set_num_threads
        random_states = save_random_states()
        launcher = kwargs.get("distributed_executor_backend") == "external_launcher"
        identity = self.shared_memory_identity = shared_memory_identity() if launcher else None
        try:
            if identity is None:
                return LLM(**kwargs)
            with external_launcher_identity(identity):
                llm = LLM(**kwargs)
            unlink_shared_memory(identity)
            return llm
        except Exception as exc:
            raise EngineError(
                f"vLLM failed to start on {self.device} with model {self.model_dir}: {type(exc).__name__}: {exc}. "
                "On CPU the attention head size must be 32, 64, 80 or more (hidden_size / num_heads); check the "
                "model config and extra.llm_kwargs."
            ) from exc
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads process-wide to guard its thread binding; the
            # in-process engine binds nothing (VLLM_CPU_OMP_THREADS_BIND=nobind), so the caller keeps control.
            if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
                torch.set_num_threads = set_num_threads
            # vLLM seeds the global RNGs of the process it runs in; the caller's streams (e.g. a colocated trainer's)
            # continue as if no engine had started
            restore_random_states(random_states)

    # --- RolloutEngine ----------------------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        return self._version

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt row (interleaved); row ``r`` uses seed ``sampling.seed + r``.

        Responses are right-padded to ``sampling.max_new_tokens`` so every rank returns the same width.
        """
        from vllm import SamplingParams as VllmSamplingParams
        from vllm import TokensPrompt

        self._check_awake("generate")
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise ConfigError(f'generate needs a "{key}" column (left-padded prompts); got {batch.keys()}')
        input_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        prompt_length, response_length = int(input_ids.shape[1]), sampling.max_new_tokens
        if prompt_length + response_length > self.max_model_len:
            raise ConfigError(
                f"prompt length {prompt_length} + max_new_tokens {response_length} exceeds the engine's "
                f"max_model_len {self.max_model_len}; raise max_prompt_length/max_new_tokens in the rollout config"
            )
        prompts = prompt_token_lists(input_ids, prompt_mask)
        if any(not prompt for prompt in prompts):
            raise ConfigError("every prompt row needs at least one attended token; got an all-padding row")
        requests, params = [], []
        for row, prompt in enumerate(prompts):
            for sample in range(sampling.n):
                index = row * sampling.n + sample
                requests.append(TokensPrompt(prompt_token_ids=prompt))
                params.append(VllmSamplingParams(
                    n=1,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    max_tokens=response_length,
                    seed=None if sampling.seed is None else sampling.seed + index,
                    logprobs=0,
                    stop_token_ids=[self.config.eos_token_id],
                    detokenize=False,
                ))
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        responses, log_probs = [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            responses.append(tokens)
            log_probs.append([step[token].logprob for step, token in zip(completion.logprobs or [], tokens)])
        repeated = batch.repeat_interleave(sampling.n)
        columns = build_rollout_columns(
            prompts=repeated["input_ids"],
            prompt_mask=repeated["attention_mask"],
            responses=responses,
            log_probs=log_probs,
            response_length=response_length,
            pad_token_id=self.config.pad_token_id,
        )
        tensors = {cast(str, key): repeated.tensors[key] for key in repeated.tensors.keys()}
        tensors.update(columns)
        meta = dict(batch.meta)
        meta["policy_version"] = self._version
        return Batch(tensors, repeated.non_tensors, meta, batch_size=len(repeated))

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = ()) -> list[TokenCompletion]:
        """Continue each id list (capability ``continue_from_tokens``); with prefix caching on, a conversation's
        earlier turns are not prefilled again. Row ``r`` uses seed ``sampling.seed + r``."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm import TokensPrompt

        self._check_awake("generate_from_tokens")
        if not prompts:
            return []
        longest = max(len(prompt) for prompt in prompts)
        if any(len(prompt) == 0 for prompt in prompts):
            raise ConfigError("generate_from_tokens got an empty prefix; every conversation starts with its prompt")
        if longest + sampling.max_new_tokens > self.max_model_len:
            raise ConfigError(f"a prefix of {longest} ids + max_new_tokens {sampling.max_new_tokens} exceeds the "
                              f"engine's max_model_len {self.max_model_len}; lower rollout.multi_turn.max_tokens or "
                              "raise the rollout engine's max_prompt_length")
        stops = sorted({self.config.eos_token_id, *(int(t) for t in stop_token_ids)})
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt in prompts]
        params = [VllmSamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                     max_tokens=sampling.max_new_tokens, logprobs=0, stop_token_ids=stops,
                                     seed=None if sampling.seed is None else sampling.seed + row, detokenize=False)
                  for row in range(len(prompts))]
        completions = []
        for output in self._llm.generate(requests, params, use_tqdm=False):
            completion = output.outputs[0]
            tokens = tuple(int(t) for t in completion.token_ids)
            log_probs = tuple(float(step[token].logprob) for step, token in zip(completion.logprobs or [], tokens))
            stopped = bool(tokens) and tokens[-1] in stops
            completions.append(TokenCompletion(token_ids=tokens, log_probs=log_probs,
                                               finish_reason="stop" if stopped else "length"))
        return completions

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load Hugging Face named weights into the running engine, without disk: full tensors, or with
        ``weights_sharded`` this rank's tensor-parallel shards (``generation_weights(tensor_parallel_size=tp)``:
        column-parallel and vocabulary rows on dim 0, row-parallel on dim 1, norms whole), which vLLM's loaders take
        as they are (:func:`hybridflow_vllm.worker_extension.mark_presharded`), so no rank builds a full tensor.

        All weights of the model must be given; vLLM fuses q/k/v and gate/up itself. The prefix cache is reset,
        since it holds KV computed with the old weights.
        """
        self._check_awake("update_weights")
        if not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a non-negative int (the policy version); got {version!r}")
        started = time.perf_counter()
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not tensors:
            raise ConfigError("update_weights got no tensors; pass the generation weights as (name, tensor) pairs")
        self._check_weights(tensors)
        try:
            self._llm.collective_rpc("hybridflow_load_weights", args=(tensors, version, self.weights_sharded))
        except Exception as exc:
            names = ", ".join(name for name, _ in tensors[:3])
            self._broken = f"loading version {version} failed half-way ({type(exc).__name__}: {exc})"
            raise EngineError(
                f"vLLM could not load {len(tensors)} tensors ({names}, ...) as version {version}: "
                f"{type(exc).__name__}: {exc}. The engine's weights are now undefined: build a new engine."
            ) from exc
        self._llm.reset_prefix_cache()
        self._version = version
        self.last_update = WeightUpdateStats(
            version=version,
            tensors=len(tensors),
            bytes=sum(tensor.numel() * tensor.element_size() for _, tensor in tensors),
            seconds=time.perf_counter() - started,
        )

    def _check_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Names and shapes must be the checkpoint's, all of them: vLLM reloads layer by layer and a partial or
        misshapen set leaves the engine half-loaded."""
        expected = self.weight_shapes
        if not expected:
            return
        given = {name: tuple(tensor.shape) for name, tensor in tensors}
        optional = {"lm_head.weight"} if "lm_head.weight" not in given else set()
        unknown = sorted(set(given) - set(expected))
        missing = sorted(set(expected) - set(given) - optional)
        misshapen = sorted(name for name in set(given) & set(expected) if given[name] != expected[name])
        what = (f"this rank's tensor-parallel shard (tp = {self.config.tensor_parallel_size})" if self.weights_sharded
                else "full shape")
        if unknown or missing or misshapen:
            detail = "; ".join(
                f"{label}: {names[:4]}{' ...' if len(names) > 4 else ''}"
                for label, names in (("unknown", unknown), ("missing", missing), ("wrong shape", misshapen))
                if names
            )
            example = misshapen[0] if misshapen else None
            shapes = f" (e.g. {example}: expected {expected[example]}, got {given[example]})" if example else ""
            raise ConfigError(
                f"update_weights expects every tensor of the checkpoint with its Hugging Face name and {what}; "
                f"got {detail}{shapes}. Send generation_weights(target='hf', tensor_parallel_size="
                f"{self.config.tensor_parallel_size if self.weights_sharded else 1}) of the whole model."
            )

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM's parameters on this rank (fused names, this rank's tensor-parallel partition; a linear weight that
        vLLM's CPU path packed into its kernel reports the partition it was packed from)."""
        self._check_awake("parameter_shapes")
        (shapes,) = self._llm.collective_rpc("hybridflow_parameter_shapes")
        return {str(name): tuple(int(d) for d in shape) for name, shape in shapes.items()}

    def update_weights_from_path(self, path: str | Path, *, version: int) -> None:
        """Reload weights from a Hugging Face directory (the fallback path that goes through disk; full tensors,
        which vLLM's loaders narrow to this rank's shard at tp > 1)."""
        self._check_awake("update_weights_from_path")
        self._llm.collective_rpc("hybridflow_load_weights_from_path", args=(str(path), version))
        self._llm.reset_prefix_cache()
        self._version = version

    def sleep(self) -> None:
        """Free the KV cache (and offload weights at level 1) while training runs; a no-op on CPU."""
        if self._asleep:
            return
        if self._sleep_enabled:
            self._llm.sleep(level=self.options.sleep_level)
        self._asleep = True

    def wake(self) -> None:
        """Restore what ``sleep`` freed."""
        if not self._asleep:
            return
        if self._sleep_enabled:
            self._llm.wake_up()
        self._asleep = False

    # --- lifecycle --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down and release its process-global state (vLLM's torch.distributed groups, temp model
        dir). An engine on the caller's ranks (``weights_sharded``) leaves the caller's world initialised; any other
        engine tears the default process group down, as vLLM does."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        if self.weights_sharded:
            # vLLM's in-process engine core shuts down (on deletion) with cleanup_dist_env_and_memory(), which
            # destroys the default process group: the caller's world here; only vLLM's own groups go
            from vllm.v1.engine import core as vllm_core

            core: Any = vllm_core
            original = core.cleanup_dist_env_and_memory
            core.cleanup_dist_env_and_memory = release_vllm_groups
            try:
                del llm
                gc.collect()
            finally:
                core.cleanup_dist_env_and_memory = original
            release_vllm_groups()
        else:
            del llm
            gc.collect()
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        self._cleanup_model_dir()

    def _cleanup_model_dir(self) -> None:
        holder: tempfile.TemporaryDirectory[str] | None = self._model_holder
        self._model_holder = None
        if holder is not None:
            holder.cleanup()

    def _check_awake(self, what: str) -> None:
        if getattr(self, "_llm", None) is None:
            raise EngineError(f"{what} on a closed vllm engine; build a new one with the rollout engine factory")
        if self._broken is not None:
            raise EngineError(f"{what} on a vllm engine whose {self._broken}; build a new engine")
        if self._asleep:
            raise EngineError(f"{what} while the vllm engine is asleep; call wake() after the training phase first")

