"""Turn a :class:`hybridflow.engines.ModelSpec` into the Hugging Face directory ``sglang.Engine(model_path=...)`` loads.

A ``path`` is used as is. A ``config`` (random init: the trainer's presets) is written to a temporary directory with
the spec's seed and dtype, config.json plus safetensors weights; no tokenizer (the adapter sends token ids,
``skip_tokenizer_init=True``). The engine that asked owns its cleanup. Stability: developer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hybridflow.engines import ModelSpec
from hybridflow.errors import ConfigError

__all__ = ["prepare_model_dir"]


def prepare_model_dir(spec: ModelSpec) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The model directory for ``spec`` and the temporary directory holding it (None for ``spec.path``)."""
    if spec.path is not None:
        return Path(spec.path), None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(spec.config or {})
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            f"model.config needs a model_type (e.g. 'qwen2') for sglang to load it; got keys {sorted(config_dict)}. "
            "Use hybridflow.presets.tiny_model_config() for a complete example, or set model.path."
        )
    config = AutoConfig.for_model(model_type, **config_dict)
    holder = tempfile.TemporaryDirectory(prefix="hybridflow-sglang-model-")
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        dtype = getattr(torch, spec.dtype)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
        # not model.save_pretrained: under torch.distributed it writes on rank 0 only, and every rank starts its own
        # engine from its own directory
        config.save_pretrained(holder.name)
        tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)  # shares embed_tokens' storage; safetensors refuses shared tensors
        save_file(tensors, str(Path(holder.name) / "model.safetensors"), metadata={"format": "pt"})
    except BaseException:
        holder.cleanup()
        raise
    finally:
        torch.random.set_rng_state(generator_state)
    return Path(holder.name), holder
