"""Turn a :class:`hybridflow.engines.ModelSpec` into the Hugging Face directory vLLM loads.

A ``path`` is used as is. A ``config`` (random init) is written to a temporary directory with the spec's seed,
the same way :func:`hybridflow.presets.save_tiny_model` writes one; the caller owns its cleanup.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hybridflow.engines import ModelSpec
from hybridflow.errors import ConfigError

__all__ = ["prepare_model_dir", "read_checkpoint_shapes"]


def prepare_model_dir(spec: ModelSpec) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The model directory for ``spec`` and the temporary directory holding it (None for ``spec.path``).

    Raises:
        ConfigError: ``spec.path`` has no ``config.json``.
    """
    if spec.path is not None:
        path = Path(spec.path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"rollout model path must be a Hugging Face model directory with config.json; got {path} "
                f"({'missing' if not path.exists() else 'no config.json'}). Pass model.path=<HF dir> or model.config."
            )
        return path, None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(spec.config or {})
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            f"model.config needs a model_type (e.g. 'qwen2'); got keys {sorted(config_dict)}. "
            "Use hybridflow.presets.tiny_model_config() for a complete example."
        )
    config = AutoConfig.for_model(model_type, **config_dict)
    holder = tempfile.TemporaryDirectory(prefix="hybridflow-vllm-model-")
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        dtype = getattr(torch, spec.dtype)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]  # untyped in HF
        # Not model.save_pretrained: under torch.distributed it writes on rank 0 only, and every rank builds its
        # own engine from its own directory.
        config.save_pretrained(holder.name)
        tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)  # shares embed_tokens' storage; safetensors refuses shared tensors
        save_file(tensors, str(Path(holder.name) / "model.safetensors"), metadata={"format": "pt"})
    finally:
        torch.random.set_rng_state(generator_state)
    return Path(holder.name), holder


def read_checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in the safetensors files of ``path`` (headers only; empty if none)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
