"""A lean forward for generation with Llama/Qwen2-shaped HF causal LMs: the model's own parameters, a preallocated
KV cache written in place, one boolean attention mask per call and no module dispatch, decorators or cache objects.

On small models the per-token cost of ``model(...)`` is Python and dispatch overhead, not arithmetic; this forward
computes the same logits with a fraction of the operations. Sampling is :mod:`hybridflow_fsdp.sampling`'s job;
models it does not recognise (other architectures, sliding windows, non-default RoPE) keep the HF forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LeanDecoder", "build_lean_decoder", "lean_decoder_unsupported_reason"]

_ARCHITECTURES = ("qwen2", "llama")


def lean_decoder_unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (None when it can)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _ARCHITECTURES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {_ARCHITECTURES}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} (only the default RoPE is implemented)"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(model, "lm_head"):
        return "no model.layers / lm_head"
    return None


class LeanDecoder:
    """``prefill`` then ``step`` over left-padded rows that advance together (stability: internal).

    Parameters are read from the modules at every call, so weights replaced in place (``update_weights``, sleep and
    wake swapping ``.data``) are always the current ones.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = lean_decoder_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        config: Any = model.config
        self.model = model
        self.layers = list(model.model.layers)  # type: ignore[union-attr]
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.eps = float(config.rms_norm_eps)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._mask = torch.empty(0, dtype=torch.bool)
        self._bias = torch.empty(0)
        self._packed: list[Any] = []
        self._cos = self._sin = torch.empty(0)
        self._length = 0

    # --- pieces ---------------------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        weight = module.weight
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _layer(self, layer: nn.Module, h: torch.Tensor, index: int, cos: torch.Tensor, sin: torch.Tensor,
               start: int | None, mask: torch.Tensor) -> torch.Tensor:
        """One decoder layer; ``start`` is the cache slot of ``h``'s first column (None: no cache, full sequence)."""
        rows, width, _ = h.shape
        attention = layer.self_attn
        x = self._norm(h, layer.input_layernorm)
        q = F.linear(x, attention.q_proj.weight, attention.q_proj.bias).view(rows, width, -1, self.head_dim)
        k = F.linear(x, attention.k_proj.weight, attention.k_proj.bias).view(rows, width, -1, self.head_dim)
        v = F.linear(x, attention.v_proj.weight, attention.v_proj.bias).view(rows, width, -1, self.head_dim)
        q = self._rope(q.transpose(1, 2), cos, sin)
        k = self._rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if start is not None:
            end = start + width
            self._k[index][:, :, start:end] = k
            self._v[index][:, :, start:end] = v
            k, v = self._k[index][:, :, :end], self._v[index][:, :, :end]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        h = h + F.linear(out.transpose(1, 2).reshape(rows, width, -1), attention.o_proj.weight, attention.o_proj.bias)
        mlp = layer.mlp
        x = self._norm(h, layer.post_attention_layernorm)
        gate = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        return h + F.linear(gate * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                            mlp.down_proj.bias)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, start: int | None,
                mask: torch.Tensor) -> torch.Tensor:
        backbone = self.model.model  # type: ignore[union-attr]
        h = F.embedding(input_ids, backbone.embed_tokens.weight)
        cos = self._cos[positions].unsqueeze(1).to(h.dtype)
        sin = self._sin[positions].unsqueeze(1).to(h.dtype)
        for index, layer in enumerate(self.layers):
            h = self._layer(layer, h, index, cos, sin, start, mask)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head  # type: ignore[union-attr]
        return F.linear(self._norm(h, self.model.model.norm), head.weight, head.bias)  # type: ignore[union-attr]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, start: int,
                 mask: torch.Tensor) -> torch.Tensor:
        return self._logits(self._hidden(input_ids, positions, start, mask)[:, -1])

    def _rope_tables(self, length: int, device: torch.device) -> None:
        if self._cos.shape[0] >= length and self._cos.device == device:
            return
        reference = torch.empty(0, dtype=torch.float32, device=device)
        rotary = self.model.model.rotary_emb  # type: ignore[union-attr]
        cos, sin = rotary(reference, torch.arange(length, device=device).unsqueeze(0))
        self._cos, self._sin = cos[0], sin[0]

    @staticmethod
    def _prompt_mask(keys: torch.Tensor) -> torch.Tensor:
        """[B, 1, W, W] causal ∧ key-valid, with the diagonal kept so padding queries stay finite."""
        width = keys.shape[-1]
        causal = torch.ones(width, width, dtype=torch.bool, device=keys.device).tril()
        return (causal & keys[:, None, None, :]) | torch.eye(width, dtype=torch.bool, device=keys.device)

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
                       last: int | None = None) -> torch.Tensor:
        """Logits [B, T, V] of a whole sequence (no cache; gradients flow), or of its ``last`` positions only."""
        self._rope_tables(int(position_ids.max()) + 1, input_ids.device)
        h = self._hidden(input_ids, position_ids, None, self._prompt_mask(attention_mask.bool()))
        return self._logits(h if last is None else h[:, -last:])

    # --- public ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        """Logits [B, V] of the last prompt position; allocates the cache for ``max_new_tokens`` more."""
        rows, width = input_ids.shape
        total = width + max_new_tokens
        backbone = self.model.model  # type: ignore[union-attr]
        parameter = backbone.embed_tokens.weight
        dtype, device = parameter.dtype, parameter.device
        self._k = [torch.empty(rows, self.num_kv_heads, total, self.head_dim, dtype=dtype, device=device)
                   for _ in self.layers]
        self._v = [torch.empty_like(k) for k in self._k]
        self._rope_tables(total + int(position_ids.max()) + 1, device)
        keys = torch.ones(rows, total, dtype=torch.bool, device=device)
        keys[:, :width] = attention_mask.bool()
        self._mask = keys[:, None, None, :]
        bias = torch.zeros(keys.shape, dtype=dtype, device=device).masked_fill_(~keys, float("-inf"))
        self._bias = bias[:, None, None]
        self._pack()
        prompt_mask = self._prompt_mask(keys[:, :width])
        self._length = width
        return self._forward(input_ids, position_ids, 0, prompt_mask)

    def _pack(self) -> None:
        """Per layer: q/k/v and gate/up weights concatenated (one matmul each per decode step)."""

        def joined(*modules: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.cat([m.weight for m in modules])
            if all(m.bias is None for m in modules):
                return weight, None
            return weight, torch.cat([m.bias if m.bias is not None else weight.new_zeros(m.weight.shape[0])
                                      for m in modules])

        self._packed = []
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self._packed.append((joined(attention.q_proj, attention.k_proj, attention.v_proj),
                                 joined(mlp.gate_proj, mlp.up_proj)))

    def _decode_layer(self, index: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      slot: int) -> torch.Tensor:
        """One layer for one new token per row: ``h`` [B, H], keys/values written to cache ``slot``."""
        layer = self.layers[index]
        (qkv_weight, qkv_bias), (gate_up_weight, gate_up_bias) = self._packed[index]
        rows, heads, kv_heads, dim = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(self._norm(h, layer.input_layernorm), qkv_weight, qkv_bias)
        qk = self._rope(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), cos, sin)
        self._k[index][:, :, slot] = qk[:, heads:]
        self._v[index][:, :, slot] = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        keys, values = self._k[index][:, :, : slot + 1], self._v[index][:, :, : slot + 1]
        query = qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim)  # head h reads kv head h // group
        scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(dim**-0.5).add_(self._bias[..., : slot + 1])
        # softmax spelled out: torch.softmax over a last dim this short costs several times exp + sum + div
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        out = torch.matmul(weights, values).div_(weights.sum(-1, keepdim=True)).view(rows, heads * dim)
        attention = layer.self_attn
        h = h + F.linear(out, attention.o_proj.weight, attention.o_proj.bias)
        gate, up = F.linear(self._norm(h, layer.post_attention_layernorm), gate_up_weight, gate_up_bias).chunk(2, -1)
        mlp = layer.mlp
        return h + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after appending ``tokens`` [B] at ``positions`` [B]."""
        slot = self._length
        self._length += 1
        backbone = self.model.model  # type: ignore[union-attr]
        h = F.embedding(tokens, backbone.embed_tokens.weight)
        cos = self._cos[positions].unsqueeze(1).to(h.dtype)
        sin = self._sin[positions].unsqueeze(1).to(h.dtype)
        for index in range(len(self.layers)):
            h = self._decode_layer(index, h, cos, sin, slot)
        return self._logits(h)

    def release(self) -> None:
        """Free the KV cache."""
        self._k, self._v, self._packed = [], [], []
        self._mask = torch.empty(0, dtype=torch.bool)
        self._bias = torch.empty(0)


def build_lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``model``, or None when it is not a supported architecture."""
    return None if lean_decoder_unsupported_reason(model) is not None else LeanDecoder(model)
