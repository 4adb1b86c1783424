"""Model presets (``model.preset`` in a config): tiny Qwen2/Llama configs over the character vocabulary (and, through
:func:`tiny_model_config`, Qwen3, Qwen3-MoE and Mixtral ones), random init, and :func:`save_tiny_model` writing one
as an HF model directory. Stability: public.

The tokenizer they pair with is :mod:`hybridflow.char_tokenizer`'s; building engines from a config is the engines'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.char_tokenizer import BOS_ID, CHAR_VOCAB, EOS_ID, PAD_ID, build_char_tokenizer
from hybridflow.errors import ConfigError

__all__ = ["ARCHITECTURES", "MODEL_PRESETS", "preset_model_config", "tiny_model_config", "save_tiny_model"]

#: ``model.preset`` name → keyword arguments of :func:`tiny_model_config`
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": {},
    "tiny-qwen2-h16": {"num_heads": 4, "num_kv_heads": 2},
    "tiny-llama": {"architecture": "llama"},
    # 4 heads / 2 KV heads, vocabulary padded to 48 (ids past the 45 characters decode to nothing): shards over tg = 2
    "tiny-qwen2-4h": {"num_heads": 4, "num_kv_heads": 2, "vocab_size": 48},
}

#: ``architecture`` of :func:`tiny_model_config` → the HF class its config names
ARCHITECTURES: dict[str, str] = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def preset_model_config(name: str) -> dict[str, Any]:
    """The HF config dict of preset ``name`` (one of :data:`MODEL_PRESETS`)."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {', '.join(MODEL_PRESETS)}")
    return tiny_model_config(**MODEL_PRESETS[name])


def tiny_model_config(
    *,
    architecture: str = "qwen2",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 256,
    vocab_size: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
) -> dict[str, Any]:
    """An HF config dict for a tiny causal LM over :data:`~hybridflow.char_tokenizer.CHAR_VOCAB`.

    The default (2 heads of 32) loads in every engine, vLLM's CPU attention included (head size 32 or more);
    ``num_heads=4, num_kv_heads=2`` gives the head-16 fixture used for the TRL comparison. ``vocab_size`` pads the
    embedding past the character vocabulary (e.g. to a multiple of the generation tensor-parallel size).
    ``architecture`` is one of :data:`ARCHITECTURES`; the mixture-of-experts ones (``qwen3_moe``, ``mixtral``) get
    ``num_experts`` experts of ``intermediate_size`` each, ``num_experts_per_tok`` of them routed per token
    (qwen3_moe with ``norm_topk_prob``, as Qwen3-30B-A3B ships).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not one of {sorted(ARCHITECTURES)}")
    if vocab_size is not None and vocab_size < len(CHAR_VOCAB):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the character vocabulary ({len(CHAR_VOCAB)})")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden {hidden_size}, heads {num_heads}, kv heads {num_kv_heads} do not divide")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "vocab_size": vocab_size or len(CHAR_VOCAB),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
    }
    if architecture == "qwen3_moe":
        config.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                      moe_intermediate_size=intermediate_size, norm_topk_prob=True)
    elif architecture == "mixtral":
        config.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    return config


def save_tiny_model(path: str | Path, *, seed: int = 0, perturb: float = 0.0, **config_overrides: Any) -> Path:
    """Write an HF model directory (config, safetensors weights, tokenizer) with random init; returns it.

    ``perturb`` > 0 moves every tensor by ``perturb``·N(0, 1) off its init (from ``seed`` + 1), so that norms (init
    to ones) and biases (zeros) carry information: what numerical comparisons between engines need.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.model_dir import hf_checkpoint_tensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_dict = tiny_model_config(**config_overrides)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped in HF
    if perturb > 0:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(perturb * torch.randn(parameter.shape, generator=generator))
    # written directly: save_pretrained writes only on rank 0 inside a torch.distributed world
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    # tied: stored once; MoE experts one tensor each (transformers 5 fuses them in memory), as save_pretrained does
    save_file(hf_checkpoint_tensors(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    build_char_tokenizer().save_pretrained(path)
    return path
