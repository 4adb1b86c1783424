"""A lean forward for generation with Llama/Qwen2/Qwen3-shaped HF causal LMs: the model's own parameters, a preallocated
KV cache written in place, one boolean attention mask per call and no module dispatch, decorators or cache objects.

On small models the per-token cost of ``model(...)`` is Python and dispatch overhead, not arithmetic; this forward
computes the same logits with a fraction of the operations. Sampling is :mod:`hybridflow_fsdp.sampling`'s job;
models it does not recognise (other architectures, sliding windows, non-default RoPE) keep the HF forward. The
forward over whole sequences (no cache) is :mod:`hybridflow_fsdp.lean_forward`'s, prefill from kept keys/values
:mod:`hybridflow_fsdp.kv_reuse`'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow_fsdp.kv_reuse import PastKV, write_past
from hybridflow_fsdp.lean_forward import LeanForward, _Linear, _Norm, lean_decoder_unsupported_reason

__all__ = ["LeanDecoder", "PastKV", "build_lean_decoder", "lean_decoder_unsupported_reason"]


class LeanDecoder(LeanForward):
    """``prefill`` then ``step`` over left-padded rows that advance together (stability: internal).

    Parameters are read from the modules at every call, so weights replaced in place (``update_weights``, sleep and
    wake swapping ``.data``) are always the current ones.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._bias = torch.empty(0)
        self._keys = torch.empty(0, dtype=torch.bool)
        self._packed: list[Any] = []
        #: per layer, Qwen3's q/k norm weights as one [H + KV, D] table (query rows pre-scaled by 1/√d); else empty
        self._qk_norms: list[torch.Tensor] = []
        self._step_cos = self._step_sin = torch.empty(0)
        self._embedding = torch.empty(0)
        self._head: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0), None)
        self._length = self._prompt_width = 0

    # --- public ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                max_new_tokens: int, *, repeats: int = 1, past: PastKV | None = None) -> torch.Tensor:
        """Logits [B·repeats, V] of the last prompt position; allocates the cache for ``max_new_tokens`` more.

        With ``repeats`` > 1 each prompt row is computed once and its keys/values are shared by ``repeats``
        consecutive rows of the cache (``repeat_interleave`` order), the layout of n samples per prompt.
        Afterwards :meth:`step` may be called without positions: row r's k-th new token sits at its last prompt
        position + 1 + k (the tables for that are made here).

        With ``past`` (keys/values of tokens computed by an earlier call, :class:`PastKV`) they fill cache slots
        ``[0, P)`` (:func:`hybridflow_fsdp.kv_reuse.write_past`) and only ``input_ids`` are computed, attending to
        them: ``position_ids`` are then absolute (row r's first new token at ``past.lengths[r]``). The logits are
        those of a prefill of the whole sequence.
        """
        rows, width = input_ids.shape
        past_width = 0 if past is None else past.keys.shape[1]
        if past is not None and repeats > 1:
            raise ValueError("prefill with past keys/values does not share prompts (repeats must be 1)")
        total = past_width + width + max_new_tokens
        backbone = self._hf.model
        parameter = backbone.embed_tokens.weight
        dtype, device = parameter.dtype, parameter.device
        self._k = [torch.empty(rows * repeats, self.num_kv_heads, total, self.head_dim, dtype=dtype, device=device)
                   for _ in self.layers]
        self._v = [torch.empty_like(k) for k in self._k]
        last = position_ids[:, -1].repeat_interleave(repeats) if repeats > 1 else position_ids[:, -1]
        self._rope_tables(int(position_ids.max()) + max_new_tokens + 1, device)
        steps = last[None, :] + torch.arange(1, max_new_tokens + 1, device=device)[:, None]  # [N, B·r]
        self._step_cos = self._cos[steps].unsqueeze(2).to(dtype)  # [N, B·r, 1, D]
        self._step_sin = self._sin[steps].unsqueeze(2).to(dtype)
        keys = torch.ones(rows, total, dtype=torch.bool, device=device)
        keys[:, past_width:past_width + width] = attention_mask.bool()
        prompt_mask = self._prompt_mask(attention_mask.bool())
        if past is not None:  # the kept keys/values in slots [0, P), the new ids attending to them
            prompt_mask = write_past(past, self._k, self._v, keys, prompt_mask)
        if repeats > 1:
            keys = keys.repeat_interleave(repeats, dim=0)
        self._keys = keys
        bias = torch.zeros(keys.shape, dtype=dtype, device=device).masked_fill_(~keys, float("-inf"))
        self._bias = bias[:, None, None]
        self._pack()
        self._length = self._prompt_width = past_width + width
        logits = self._prefill_forward(input_ids, position_ids, prompt_mask, repeats)
        return logits.repeat_interleave(repeats, dim=0) if repeats > 1 else logits

    def _prefill_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                         repeats: int) -> torch.Tensor:
        """The prompts through the packed weights (as :meth:`_decode_layer`), filling cache slots ``[S, S + W)`` (each
        prompt row into ``repeats`` consecutive cache rows) and attending to slots ``[0, S + W)`` (S: the past
        keys/values' width, 0 without); logits [B, V] of the last position."""
        rows, width = input_ids.shape
        start = self._length - width
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        h = self._embed(input_ids)
        cos = self._cos[positions].unsqueeze(2).to(h.dtype)  # [B, W, 1, D]
        sin = self._sin[positions].unsqueeze(2).to(h.dtype)
        shape = (rows, repeats, kv_heads, self._k[0].shape[2], dim)
        for index in range(len(self.layers)):
            (qkv_weight, qkv_bias), (o_weight, o_bias), (gate_up_weight, gate_up_bias), (down_weight, down_bias) = \
                self._packed[index]
            qkv = F.linear(self._plain_norm(h), qkv_weight, qkv_bias)
            qk = qkv[..., : (heads + kv_heads) * dim].view(rows, width, heads + kv_heads, dim)
            if self._qk_norms:
                qk = self._scaled_head_norm(qk, index)
            qk = self._rope(qk, cos, sin).transpose(1, 2)  # [B, H+KV, W, D]
            k = qk[:, heads:]
            v = qkv[..., (heads + kv_heads) * dim :].view(rows, width, kv_heads, dim).transpose(1, 2)
            self._k[index].view(shape)[:, :, :, start:start + width] = k.unsqueeze(1)
            self._v[index].view(shape)[:, :, :, start:start + width] = v.unsqueeze(1)
            if start:  # continuing: attend to the past keys/values too
                k, v = self._k[index][:, :, :start + width], self._v[index][:, :, :start + width]
            out = F.scaled_dot_product_attention(qk[:, :heads], k, v, attn_mask=mask, scale=1.0,  # q pre-scaled
                                                 enable_gqa=kv_heads != heads)
            h = h + self._row(out.transpose(1, 2).reshape(rows, width, heads * dim), o_weight, o_bias)
            gate, up = F.linear(self._plain_norm(h), gate_up_weight, gate_up_bias).chunk(2, -1)
            h = h + self._row(F.silu(gate).mul_(up), down_weight, down_bias)
        return self._head_logits(h[:, -1])

    def _pack(self) -> None:
        """Per layer: q/k/v and gate/up weights concatenated (one matmul each per decode step), with the RMSNorm
        weight that precedes them folded in (``norm(x)·g @ Wᵀ = norm(x) @ (W·g)ᵀ``), and direct references to the
        rest, so a decode step does no module attribute lookups."""

        def joined(norm: _Norm, *modules: _Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.cat([m.weight for m in modules])
            weight = (weight.float() * norm.weight.float()).to(weight.dtype)
            if all(m.bias is None for m in modules):
                return weight, None
            return weight, torch.cat([m.bias if m.bias is not None else weight.new_zeros(m.weight.shape[0])
                                      for m in modules])

        self._packed = []
        self._qk_norms = []
        query_rows = self.num_heads * self.head_dim
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias = joined(layer.input_layernorm, attention.q_proj, attention.k_proj, attention.v_proj)
            if self.qk_norm:  # the query norm's output is scale-free: the 1/√d goes into its weight instead
                dim = self.head_dim
                self._qk_norms.append(torch.cat((attention.q_norm.weight.expand(self.num_heads, dim) * dim**-0.5,
                                                 attention.k_norm.weight.expand(self.num_kv_heads, dim))))
            else:  # the 1/√d of the attention scores folded into the query rows (RoPE is linear, so it commutes)
                qkv_weight[:query_rows] *= self.head_dim**-0.5
            if qkv_bias is not None and not self.qk_norm:
                qkv_bias = qkv_bias.clone()
                qkv_bias[:query_rows] *= self.head_dim**-0.5
            self._packed.append(((qkv_weight, qkv_bias),
                                 (attention.o_proj.weight, attention.o_proj.bias),
                                 joined(layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj),
                                 (mlp.down_proj.weight, mlp.down_proj.bias)))
        backbone, head = self._hf.model, self._hf.lm_head
        self._embedding = backbone.embed_tokens.weight
        self._head = joined(backbone.norm, head)

    # the three places a tensor-parallel subclass communicates (hybridflow_fsdp.tensor_parallel)
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self._embedding)

    def _row(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The o_proj / down_proj matmul (row-parallel under tensor parallelism)."""
        return F.linear(x, weight, bias)

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._plain_norm(h), *self._head)

    def _scaled_head_norm(self, qk: torch.Tensor, index: int) -> torch.Tensor:
        """Qwen3's q/k norms over ``qk`` [..., H + KV, D] with layer ``index``'s table (queries pre-scaled)."""
        weight = self._qk_norms[index]
        if qk.dtype == torch.float32:
            return F.rms_norm(qk, (qk.shape[-1],), None, self.eps) * weight
        return weight * F.rms_norm(qk.float(), (qk.shape[-1],), None, self.eps).to(qk.dtype)

    def _plain_norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (folded into the next matmul by :meth:`_pack`)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), None, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _decode_layer(self, index: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      slot: int) -> torch.Tensor:
        """One layer for one new token per row: ``h`` [B, H], keys/values written to cache ``slot``."""
        (qkv_weight, qkv_bias), (o_weight, o_bias), (gate_up_weight, gate_up_bias), (down_weight, down_bias) = \
            self._packed[index]
        rows, heads, kv_heads, dim = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(self._plain_norm(h), qkv_weight, qkv_bias)
        qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
        if self._qk_norms:
            qk = self._scaled_head_norm(qk, index)
        qk = self._rope(qk, cos, sin)
        self._k[index][:, :, slot] = qk[:, heads:]
        self._v[index][:, :, slot] = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        keys, values = self._k[index][:, :, : slot + 1], self._v[index][:, :, : slot + 1]
        query = qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim)  # head h reads kv head h // group
        scores = torch.matmul(query, keys.transpose(-1, -2)).add_(self._bias[..., : slot + 1])  # query pre-scaled
        # softmax spelled out: torch.softmax over a last dim this short costs several times exp + sum + div
        weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        out = torch.matmul(weights, values).div_(weights.sum(-1, keepdim=True)).view(rows, heads * dim)
        h = h + self._row(out, o_weight, o_bias)
        gate, up = F.linear(self._plain_norm(h), gate_up_weight, gate_up_bias).chunk(2, -1)
        return h + self._row(F.silu(gate).mul_(up), down_weight, down_bias)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] after appending ``tokens`` [B] at ``positions`` [B] (default: the next position of every
        row, from the tables :meth:`prefill` made)."""
        slot = self._length
        self._length += 1
        h = self._embed(tokens)
        if positions is None:
            cos, sin = self._step_cos[slot - self._prompt_width], self._step_sin[slot - self._prompt_width]
        else:
            cos = self._cos[positions].unsqueeze(1).to(h.dtype)
            sin = self._sin[positions].unsqueeze(1).to(h.dtype)
        for index in range(len(self.layers)):
            h = self._decode_layer(index, h, cos, sin, slot)
        return self._head_logits(h)

    def cache_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int]:
        """What the cache holds now (before :meth:`release`): keys and values [B, KV, T, D] per layer, the key mask
        [B, T] (False on padding and holes) and the prefill width (slots from it on hold the tokens given to
        :meth:`step`, one per step)."""
        length = self._length
        return ([k[:, :, :length] for k in self._k], [v[:, :, :length] for v in self._v], self._keys[:, :length],
                self._prompt_width)

    def release(self) -> None:
        """Free the KV cache."""
        self._k, self._v, self._packed, self._qk_norms = [], [], [], []
        self._keys = torch.empty(0, dtype=torch.bool)
        self._embedding, self._head = torch.empty(0), (torch.empty(0), None)  # no reference to the weights kept
        self._bias = torch.empty(0)
        self._step_cos = self._step_sin = torch.empty(0)


def build_lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``model``, or None when it is not a supported architecture."""
    return None if lean_decoder_unsupported_reason(model) is not None else LeanDecoder(model)
