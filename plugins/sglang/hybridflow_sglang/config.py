"""Map hybridflow's rollout config and sampling params onto SGLang's ``ServerArgs`` keywords and ``sampling_params``.

Pure functions over plain data: nothing here imports sglang or starts an engine (see :mod:`hybridflow_sglang.engine`).
Stability: public (the ``extra`` keys are documented in docs/guide/sglang.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hybridflow.engines import RolloutEngineConfig, SamplingParams
from hybridflow.errors import ConfigError
from hybridflow_sglang.api import MEMORY_TAG_KV_CACHE, MEMORY_TAG_WEIGHTS

__all__ = ["SUPPORTED_DEVICES", "SGLangOptions", "build_sampling_params", "build_server_args", "derive_sample_seed",
           "device_index", "device_server_args", "parse_options"]

_KNOWN_TAGS = (MEMORY_TAG_KV_CACHE, MEMORY_TAG_WEIGHTS, "cuda_graph")
#: server args derived from typed config fields; ``server_args`` in ``extra`` may not override them
_DERIVED = {"model_path": "model.path", "tp_size": "tensor_parallel_size", "random_seed": "seed",
            "dtype": "model.dtype",
            "context_length": "max_prompt_length + max_new_tokens", "base_gpu_id": "the worker's device",
            "device": "the worker's device"}
#: torch device kinds the adapter passes to sglang's ``device`` server arg
SUPPORTED_DEVICES = ("cuda", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class SGLangOptions:
    """SGLang-specific settings, read from ``RolloutEngineConfig.extra``.

    Args:
        mem_fraction_static: fraction of GPU memory for weights + KV cache (sglang ``mem_fraction_static``).
        enable_memory_saver: lets ``sleep()`` / ``wake()`` release and resume GPU memory (torch_memory_saver).
        enable_weights_cpu_backup: keep a CPU copy of released weights, so ``wake()`` without an update is valid.
        enable_deterministic_inference: needed for ``SamplingParams.seed`` (sglang honours ``sampling_seed`` only
            in this mode, with its pytorch sampler).
        memory_tags: what ``sleep()`` releases.
        weight_bucket_bytes: bytes per ``update_weights_from_tensor`` call.
        server_args: further ``ServerArgs`` keywords passed through unchanged.
    """

    mem_fraction_static: float = 0.5
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    enable_deterministic_inference: bool = False
    memory_tags: tuple[str, ...] = (MEMORY_TAG_KV_CACHE, MEMORY_TAG_WEIGHTS)
    weight_bucket_bytes: int = 512 << 20
    server_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"extra.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        unknown = [tag for tag in self.memory_tags if tag not in _KNOWN_TAGS]
        if unknown or not self.memory_tags:
            raise ConfigError(f"extra.memory_tags must be a non-empty subset of {_KNOWN_TAGS}, got {self.memory_tags}")
        if self.weight_bucket_bytes <= 0:
            raise ConfigError(f"extra.weight_bucket_bytes must be > 0, got {self.weight_bucket_bytes}")
        clashes = sorted(set(self.server_args) & set(_DERIVED))
        if clashes:
            hints = ", ".join(f"{key} (set RolloutEngineConfig {_DERIVED[key]})" for key in clashes)
            raise ConfigError(f"extra.server_args may not set {hints}: they are derived from the typed config.")


def parse_options(extra: Mapping[str, Any]) -> SGLangOptions:
    """Build :class:`SGLangOptions` from ``extra``; unknown keys raise listing the known ones."""
    known = {f.name for f in fields(SGLangOptions)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(
            f"unknown sglang rollout option(s) {unknown}; known: {sorted(known)}. Put other sglang ServerArgs "
            'keywords under extra["server_args"].'
        )
    values = dict(extra)
    if "memory_tags" in values:
        values["memory_tags"] = tuple(values["memory_tags"])
    return SGLangOptions(**values)


def device_index(device: str) -> int:
    """GPU index of a torch device string (``"cuda"`` → 0, ``"cuda:3"`` → 3); other devices raise ConfigError."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        raise ConfigError(f'expected a CUDA device ("cuda" or "cuda:<index>"), got {device!r}')
    if index and not index.isdigit():
        raise ConfigError(f"cannot read a GPU index from device {device!r}; expected e.g. 'cuda:0'")
    return int(index or 0)


def device_server_args(device: str) -> dict[str, Any]:
    """sglang's ``device`` (and ``base_gpu_id`` on a GPU) for the worker's torch device string."""
    kind = device.partition(":")[0]
    if kind not in SUPPORTED_DEVICES:
        raise ConfigError(
            f'rollout engine "sglang" runs on {" or ".join(SUPPORTED_DEVICES)}: expected device "cuda", "cuda:<index>" '
            f'or "cpu", got {device!r}. Place the rollout on a cuda (or cpu) resource pool.'
        )
    if kind == "cpu":
        return {"device": "cpu"}
    return {"device": "cuda", "base_gpu_id": device_index(device)}


def build_server_args(config: RolloutEngineConfig, options: SGLangOptions, *, device: str,
                      model_path: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine(**server_args)`` for ``config`` on ``device``.

    ``model_path`` is the HF directory to load when ``config.model`` has only a ``config`` (random init); the engine
    writes it (:func:`hybridflow_sglang.model_dir.prepare_model_dir`).
    """
    path = config.model.path or model_path
    if path is None:
        raise ConfigError(
            'rollout engine "sglang" loads an HF model directory: expected model.path, got only model.config and no '
            "materialised directory. Save the model first (e.g. hybridflow.presets.save_tiny_model or "
            "model.save_pretrained) and pass its path."
        )
    args: dict[str, Any] = {
        "model_path": str(path),
        "tp_size": config.tensor_parallel_size,
        "dtype": config.model.dtype,
        "random_seed": config.seed,
        "skip_tokenizer_init": True,
        "mem_fraction_static": options.mem_fraction_static,
        "enable_memory_saver": options.enable_memory_saver,
        "enable_weights_cpu_backup": options.enable_weights_cpu_backup,
        "enable_deterministic_inference": options.enable_deterministic_inference,
        "context_length": config.max_prompt_length + config.max_new_tokens,
        **device_server_args(device),
        "log_level": "error",
    }
    args.update(options.server_args)
    return args


def derive_sample_seed(seed: int, row: int) -> int:
    """A per-row ``sampling_seed`` (63-bit, stable across processes) so n seeded samples of one prompt differ."""
    digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def build_sampling_params(
    sampling: SamplingParams, *, rows: int, eos_token_id: int
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang ``sampling_params`` for ``rows`` prompts.

    Unseeded: one dict with ``n`` (sglang expands each prompt into n samples, prompt-major). Seeded: the caller has
    already repeated each prompt n times, and each row gets its own ``sampling_seed`` derived from the seed.
    ``top_k == 0`` (off) becomes sglang's ``-1``; ``temperature == 0`` is greedy in both.
    """
    base: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "stop_token_ids": [eos_token_id],
        "no_stop_trim": True,
    }
    if sampling.seed is None:
        return {**base, "n": sampling.n}
    return [{**base, "n": 1, "sampling_seed": derive_sample_seed(sampling.seed, row)} for row in range(rows)]
