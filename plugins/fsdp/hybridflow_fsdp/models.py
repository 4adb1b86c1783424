"""Build the HF model a role needs (causal LM, token-value head, sequence-score head) from a ``ModelSpec``.

It builds plain single-device modules; sharding them (FSDP) and moving weights between engines is left to the
training engine and the rollout engine.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from hybridflow.columns import compute_position_ids  # re-exported: the fsdp modules import it from here
from hybridflow.engines import ModelSpec
from hybridflow.errors import ConfigError

__all__ = ["DTYPES", "build_hf_config", "build_model", "compute_position_ids", "transformer_blocks"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: role → the HF auto class that builds its head
_AUTO_CLASS = {
    "actor": "AutoModelForCausalLM",
    "reference": "AutoModelForCausalLM",
    "rollout": "AutoModelForCausalLM",
    "critic": "AutoModelForTokenClassification",
    "reward_model": "AutoModelForSequenceClassification",
}


def build_hf_config(spec: ModelSpec, *, role: str, attn_implementation: str = "sdpa") -> Any:
    """The ``transformers`` config of ``spec`` with the head settings ``role`` needs (1 label, no dropout)."""
    from transformers import AutoConfig

    if spec.path is not None:
        config = AutoConfig.from_pretrained(spec.path)
    else:
        values = dict(spec.config or {})
        model_type = values.pop("model_type", None)
        if not model_type:
            raise ConfigError(
                f"model.config needs a `model_type` key (e.g. \"qwen2\"); got keys {sorted(values)}. "
                "Use hybridflow.presets.tiny_model_config() for a complete example."
            )
        values.pop("torch_dtype", None)
        config = AutoConfig.for_model(model_type, **values)
    if role in ("critic", "reward_model"):
        config.num_labels = 1
        config.classifier_dropout = 0.0
    config._attn_implementation = attn_implementation
    return config


def build_model(spec: ModelSpec, *, role: str, attn_implementation: str = "sdpa") -> nn.Module:
    """The model of ``role`` on CPU in ``spec.dtype``: loaded from ``spec.path`` or randomly initialised from
    ``spec.seed``.

    A critic or reward model loaded from a causal-LM directory keeps the backbone and gets a fresh 1-output
    ``score`` head (initialised from ``spec.seed``), which is how a critic starts from the actor's weights.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    transformers.utils.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # unannotated in transformers
    if role not in _AUTO_CLASS:
        raise ConfigError(f"unknown role {role!r}; expected one of {sorted(_AUTO_CLASS)}")
    auto_class = getattr(transformers, _AUTO_CLASS[role])
    config = build_hf_config(spec, role=role, attn_implementation=attn_implementation)
    dtype = DTYPES[spec.dtype]
    torch.manual_seed(spec.seed)  # same seed on every rank → identical random init (and fresh heads) everywhere
    if spec.path is not None:
        model = auto_class.from_pretrained(spec.path, config=config, dtype=dtype)
    else:
        model = auto_class.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return cast(nn.Module, model)  # auto_class is looked up by name, so typed Any


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF model (the units FSDP shards one by one)."""
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(backbone, "layers", None) if backbone is not None else None
    if layers is None:
        raise ConfigError(
            f"cannot find decoder layers on {type(model).__name__}: expected "
            f"`.{getattr(model, 'base_model_prefix', 'model')}.layers` as in Llama/Qwen2/Mistral HF models; "
            "other architectures need their own wrap policy"
        )
    return list(layers)
