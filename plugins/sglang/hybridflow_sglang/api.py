"""Every piece of SGLang's API this plugin touches, declared once, and the lazy import that binds them.

The list :data:`API_USES` drives the API-drift test (``tests/plugins/sglang/test_api_drift.py``), which parses the
released sglang wheel without importing it; code here must only call what the list declares. Importing this module
imports no sglang: :func:`load_sglang_backend` does, inside the engine factory. Stability: developer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybridflow.errors import EngineError

__all__ = [
    "SGLANG_CHECKED_VERSION",
    "ApiUse",
    "API_USES",
    "ENGINE_MODULE",
    "SERVER_ARG_NAMES",
    "SAMPLING_PARAM_NAMES",
    "MEMORY_TAG_KV_CACHE",
    "MEMORY_TAG_WEIGHTS",
    "ORIGINAL_LOGPROB_ENV",
    "SGLangEngineLike",
    "SGLangBackend",
    "load_sglang_backend",
]

#: the sglang release the declarations below were checked against (the drift test downloads this wheel)
SGLANG_CHECKED_VERSION = "0.5.23"

ENGINE_MODULE = "sglang.srt.entrypoints.engine"
UPDATER_MODULE = "sglang.srt.model_executor.model_runner_components.weight_updater"
UTILS_MODULE = "sglang.srt.utils.common"

#: ``ServerArgs`` keys the adapter sets (sglang assembles ServerArgs from the namespaces in ``arg_groups/fields``)
SERVER_ARG_NAMES: tuple[str, ...] = (
    "model_path",
    "tp_size",
    "dtype",
    "random_seed",
    "skip_tokenizer_init",
    "mem_fraction_static",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "enable_deterministic_inference",
    "context_length",
    "base_gpu_id",
    "device",
    "log_level",
)
#: keys of the ``sampling_params`` dict the adapter sends
SAMPLING_PARAM_NAMES: tuple[str, ...] = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop_token_ids",
    "no_stop_trim",
    "sampling_seed",
)
#: memory tags of ``release_memory_occupation`` / ``resume_memory_occupation`` (sglang.srt.constants)
MEMORY_TAG_KV_CACHE = "kv_cache"
MEMORY_TAG_WEIGHTS = "weights"
#: env var that makes sglang return log-probs before temperature (the ``rollout_log_probs`` contract)
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


@dataclass(frozen=True, kw_only=True, slots=True)
class ApiUse:
    """One thing of sglang the plugin uses, as found in the sglang source tree.

    ``owner`` is a class name, ``"*"`` (any class of the module or of every module of the package: sglang builds
    ``ServerArgs`` from such namespace classes), ``"<strings>"`` (string literals of the module, e.g. output dict
    keys) or None (module level). ``member`` is a method/function name, or None to check class fields / module
    names. ``keywords`` are keyword arguments of ``member``, or field names, or ``NAME=value`` module constants.
    """

    module: str
    owner: str | None
    member: str | None
    keywords: tuple[str, ...] = ()


API_USES: tuple[ApiUse, ...] = (
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="__init__"),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="generate",
           keywords=("input_ids", "sampling_params", "return_logprob")),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="update_weights_from_tensor",
           keywords=("named_tensors", "load_format", "flush_cache")),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="init_weights_update_group",
           keywords=("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="update_weights_from_distributed",
           keywords=("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format")),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="destroy_weights_update_group", keywords=("group_name",)),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="release_memory_occupation", keywords=("tags",)),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="resume_memory_occupation", keywords=("tags",)),
    ApiUse(module=ENGINE_MODULE, owner="Engine", member="shutdown"),
    ApiUse(module="sglang.srt.arg_groups.fields", owner="*", member=None, keywords=SERVER_ARG_NAMES),
    ApiUse(module="sglang.srt.sampling.sampling_params", owner="SamplingParams", member=None,
           keywords=SAMPLING_PARAM_NAMES),
    ApiUse(module="sglang.srt.constants", owner=None, member=None,
           keywords=(f"GPU_MEMORY_TYPE_KV_CACHE={MEMORY_TAG_KV_CACHE}",
                     f"GPU_MEMORY_TYPE_WEIGHTS={MEMORY_TAG_WEIGHTS}")),
    ApiUse(module="sglang.srt.managers.tokenizer_manager", owner="<strings>", member=None,
           keywords=("output_ids", "meta_info", "output_token_logprobs", "finish_reason")),
    ApiUse(module="sglang.srt.layers.sampler", owner="<strings>", member=None, keywords=(ORIGINAL_LOGPROB_ENV,)),
    ApiUse(module=UPDATER_MODULE, owner="LocalSerializedTensor", member=None, keywords=("values",)),
    ApiUse(module=UPDATER_MODULE, owner=None, member="_model_load_weights_direct"),
    ApiUse(module=UTILS_MODULE, owner="MultiprocessingSerializer", member="serialize", keywords=("obj",)),
    ApiUse(module=UTILS_MODULE, owner=None, member="init_custom_process_group",
           keywords=("backend", "init_method", "world_size", "rank", "group_name")),
)


class SGLangEngineLike(Protocol):
    """The methods of ``sglang.srt.entrypoints.engine.Engine`` the adapter calls (see :data:`API_USES`)."""

    def generate(self, *, input_ids: list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]],
                 return_logprob: bool) -> list[dict[str, Any]] | dict[str, Any]: ...  # a dict for one prompt

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], load_format: str | None = None,
                                   flush_cache: bool = True) -> Any: ...

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> Any: ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: str | None = None) -> Any: ...

    def destroy_weights_update_group(self, group_name: str) -> Any: ...

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any: ...

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class SGLangBackend:
    """The sglang callables the adapter needs, bound lazily (tests substitute a declared test double)."""

    engine_class: Callable[..., SGLangEngineLike]
    serialize: Callable[[Any], Any]
    local_serialized_tensor: Callable[[list[Any]], Any]
    init_custom_process_group: Callable[..., Any]


def load_sglang_backend() -> SGLangBackend:
    """Import sglang and bind :class:`SGLangBackend`; a missing or broken install raises :class:`EngineError`."""
    try:
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
    except ImportError as exc:
        raise EngineError(
            f'rollout engine "sglang" needs the sglang package (checked against sglang=={SGLANG_CHECKED_VERSION}); '
            f"importing it failed: {type(exc).__name__}: {exc}. Fix: on a machine with a CUDA GPU run "
            f'`pip install "hybridflow-sglang[sglang]"`, or pick another rollout engine (rollout.engine=vllm or hf). '
            "sglang ships CUDA-only kernels; it cannot run on a CPU-only machine."
        ) from exc
    return SGLangBackend(
        engine_class=Engine,
        serialize=MultiprocessingSerializer.serialize,
        local_serialized_tensor=lambda values: LocalSerializedTensor(values=values),
        init_custom_process_group=init_custom_process_group,
    )


def check_update_result(result: Any, *, what: str) -> None:
    """Raise :class:`EngineError` when an sglang ``(success, message)`` result reports failure."""
    if isinstance(result, Sequence) and not isinstance(result, (str, bytes)) and len(result) >= 1:
        success, message = bool(result[0]), (str(result[1]) if len(result) > 1 else "")
        if not success:
            raise EngineError(
                f"sglang {what} failed: expected success=True, got success=False with message {message!r}. The "
                "rollout weights are now in an unknown state; push the full weights again before generating."
            )
