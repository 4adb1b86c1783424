"""Model shapes for cost estimates: built from a Hugging Face config, a size such as "7b", or a preset.

Only shapes and dtypes are read; no weights are loaded, and how a model is sharded is the simulator's concern.
Stability: developer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError

__all__ = ["ModelSpec", "LLAMA_PRESETS", "parse_model", "model_from_hf_config", "model_from_size"]

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8": 1, "int8": 1}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only transformer's shape; ``parameters`` is derived from it."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"Model {self.name!r}: {field} must be >= 1, got {getattr(self, field)}.")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError(f"Model {self.name!r}: hidden_size ({self.hidden_size}) must divide by num_heads "
                              f"({self.num_heads}) and num_heads by num_kv_heads ({self.num_kv_heads}).")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def parameters(self) -> int:
        """Parameter count: embeddings, attention (with grouped KV), gated MLP, norms, and the output head."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tied_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _llama(name: str, h: int, layers: int, heads: int, kv: int, inter: int) -> ModelSpec:
    return ModelSpec(name=name, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     intermediate_size=inter, vocab_size=32000)


LLAMA_PRESETS: dict[str, ModelSpec] = {
    "7b": _llama("llama-7b", 4096, 32, 32, 32, 11008),
    "13b": _llama("llama-13b", 5120, 40, 40, 40, 13824),
    "34b": _llama("llama-34b", 8192, 48, 64, 8, 22016),
    "70b": _llama("llama-70b", 8192, 80, 64, 8, 28672),
    "tiny": ModelSpec(name="tiny", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=128, vocab_size=64, dtype_bytes=4, tied_embeddings=True),
}


def model_from_hf_config(config: dict[str, Any], name: str = "hf-model") -> ModelSpec:
    """Read the shape keys of a Hugging Face ``config.json`` (Llama, Qwen2, Mistral naming)."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        spec = ModelSpec(
            name=str(config.get("_name_or_path") or name),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config["vocab_size"]),
            dtype_bytes=_DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")).replace("torch.", ""), 2),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ConfigError(f"Hugging Face config {name!r} lacks key {exc.args[0]!r}; expected hidden_size, "
                          "num_hidden_layers, num_attention_heads and vocab_size.") from exc
    return spec


def model_from_size(parameters: float, name: str | None = None) -> ModelSpec:
    """Build a Llama-like shape with about ``parameters`` parameters (hidden = 128 · layers, MLP = 8/3 · hidden)."""
    if parameters < 1e5:
        raise ConfigError(f"Model size must be at least 1e5 parameters, got {parameters:g}.")
    # 12·L·h² ≈ parameters with h = 128·L  →  L = (parameters / (12·128²))^(1/3)
    layers = max(2, round((parameters / (12 * 128**2)) ** (1 / 3)))
    hidden = max(128, round(math.sqrt(parameters / (12 * layers)) / 128) * 128)
    heads = hidden // 128
    inter = round(hidden * 8 / 3 / 256) * 256
    return ModelSpec(name=name or f"{parameters / 1e9:g}b", hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=heads, intermediate_size=inter, vocab_size=32000)


def parse_model(text: str) -> ModelSpec:
    """Parse a CLI model argument: a preset ("7b", "70B", "tiny"), a size ("1.5b", "350m") or a config path."""
    key = text.strip().lower()
    if key in LLAMA_PRESETS:
        return LLAMA_PRESETS[key]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bm])", key)
    if match:
        scale = 1e9 if match.group(2) == "b" else 1e6
        return model_from_size(float(match.group(1)) * scale, name=key)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"Could not read Hugging Face config {path}: {exc}.") from exc
        return model_from_hf_config(config, name=path.parent.name)
    raise ConfigError(f"Model {text!r} is neither a preset ({', '.join(LLAMA_PRESETS)}), a size like '7b' or "
                      "'350m', nor a path to a Hugging Face config.json or its folder.")
