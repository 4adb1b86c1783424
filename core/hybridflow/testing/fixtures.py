"""Tiny real fixtures: a character-level HF tokenizer made locally and tiny Qwen2/Llama configs with random init.

They need ``transformers`` and ``tokenizers`` (installed with the FSDP plugin); no model or data hub is touched.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

__all__ = [
    "SPECIAL_TOKENS",
    "CHAR_VOCAB",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "build_char_tokenizer",
    "tiny_model_config",
    "save_tiny_model",
]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(string.digits) + ("+", "-", "*", "=", " ") + tuple(
    string.ascii_lowercase
)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_char_tokenizer() -> Any:
    """A 45-token character-level ``PreTrainedTokenizerFast`` (digits, + - * =, space, a–z, 4 specials)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(CHAR_VOCAB)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", ignore_merges=True))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated __init__ in transformers
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


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
) -> dict[str, Any]:
    """An HF config dict for a tiny causal LM over :data:`CHAR_VOCAB`.

    The default (2 heads of 32) loads in every engine, vLLM's CPU attention included (head size 32 or more);
    ``num_heads=4, num_kv_heads=2`` gives the head-16 fixture used for the TRL comparison.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden {hidden_size}, heads {num_heads}, kv heads {num_kv_heads} do not divide")
    model_type = {"qwen2": "qwen2", "llama": "llama"}[architecture]
    return {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": len(CHAR_VOCAB),
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


def save_tiny_model(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write an HF model directory (config, safetensors weights, tokenizer) with random init; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_dict = tiny_model_config(**config_overrides)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped in HF
    # written directly: save_pretrained writes only on rank 0 inside a torch.distributed world
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (config.tie_word_embeddings and name == "lm_head.weight")}  # tied: stored once, as HF does
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    build_char_tokenizer().save_pretrained(path)
    return path
