"""The lean forward of Llama/Qwen2/Qwen3-shaped HF causal LMs over whole sequences (no cache; gradients flow): the
model's own parameters read at every call, no module dispatch, and rows that repeat a prompt sharing its forward.

The training engine scores responses with it (:meth:`LeanForward.response_logits`); generation with a KV cache is
:class:`hybridflow_fsdp.fast_decode.LeanDecoder`'s, which extends it. Qwen3's q/k RMSNorms (per head, before RoPE) are
applied where its config says so. Models it does not recognise (other families, mixture-of-experts MLPs, sliding
windows, non-default RoPE) keep the HF forward: :func:`lean_decoder_unsupported_reason` says why and logs it once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow_fsdp.prompt_sharing import distinct_prompt_rows

__all__ = ["LEAN_FAMILIES", "QK_NORM_FAMILIES", "LeanForward", "lean_decoder_unsupported_reason",
           "upcast_for_backward"]

#: the HF ``model_type`` values the lean forward and decoder compute (dense SwiGLU MLP, default RoPE, full attention)
LEAN_FAMILIES = ("llama", "qwen2", "qwen3")
#: those of them with an RMSNorm over each query/key head before RoPE (HF ``self_attn.q_norm`` / ``k_norm``)
QK_NORM_FAMILIES = ("qwen3",)
_logger = logging.getLogger(__name__)
_logged_reasons: set[tuple[str, str]] = set()


# The attributes this forward reads from an HF Llama/Qwen2/Qwen3 model (torch types submodule attributes as
# ``Tensor | Module``); :func:`lean_decoder_unsupported_reason` checks the architecture before the cast.
class _Linear(Protocol):
    weight: torch.Tensor
    bias: torch.Tensor | None


class _Norm(Protocol):
    weight: torch.Tensor


class _Attention(Protocol):
    q_proj: _Linear
    k_proj: _Linear
    v_proj: _Linear
    o_proj: _Linear
    q_norm: _Norm  # QK_NORM_FAMILIES only
    k_norm: _Norm


class _Mlp(Protocol):
    gate_proj: _Linear
    up_proj: _Linear
    down_proj: _Linear


class _DecoderLayer(Protocol):
    self_attn: _Attention
    mlp: _Mlp
    input_layernorm: _Norm
    post_attention_layernorm: _Norm


class _Backbone(Protocol):
    embed_tokens: _Norm
    layers: list[_DecoderLayer]
    norm: _Norm
    rotary_emb: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _CausalLM(Protocol):
    model: _Backbone
    lm_head: _Linear


def lean_decoder_unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`LeanForward` / :class:`LeanDecoder` cannot run ``model`` (None when they can).

    The fallback rule: a model this returns a reason for runs HF's own modules (the generic path) in every engine that
    asks, never a lean forward that would compute other numbers. Each distinct reason is logged once per process
    (INFO, naming the model_type), so a run says why its fast path is off.
    """
    reason = _unsupported_reason(model)
    if reason is not None:
        model_type = str(getattr(getattr(model, "config", None), "model_type", None))
        if (model_type, reason) not in _logged_reasons:
            _logged_reasons.add((model_type, reason))
            _logger.info("the lean forward/decoder does not run model_type %r (%s): HF's modules run instead",
                         model_type, reason)
    return reason


def _unsupported_reason(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or model_type not in LEAN_FAMILIES:
        moe = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
        return (f"model_type {model_type!r} is not one of {LEAN_FAMILIES}"
                + (" (mixture-of-experts MLPs are not in the lean forward)" if moe else ""))
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} (only the default RoPE is implemented)"
    if getattr(config, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(model, "lm_head"):
        return "no model.layers / lm_head"
    if model_type in QK_NORM_FAMILIES and not all(
            hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn, "k_norm") for layer in backbone.layers):
        return f"a {model_type} attention without q_norm/k_norm"
    return None


class LeanForward:
    """The model's layers as plain torch ops over whole sequences (stability: internal).

    Parameters are read from the modules at every call, so weights replaced in place (``update_weights``, sleep and
    wake swapping ``.data``) are always the current ones.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = lean_decoder_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        config: Any = model.config
        self.model = model
        self._hf = cast(_CausalLM, model)
        self.layers = list(self._hf.model.layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.eps = float(config.rms_norm_eps)
        #: Qwen3: an RMSNorm over each query and key head (HF ``q_norm``/``k_norm``), before RoPE
        self.qk_norm = config.model_type in QK_NORM_FAMILIES
        self._cos = self._sin = torch.empty(0)

    # --- pieces ---------------------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, module: _Norm) -> torch.Tensor:
        weight = module.weight
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _head_norm(self, qk: torch.Tensor, attention: _Attention, heads: int, kv_heads: int) -> torch.Tensor:
        """Qwen3's q/k RMSNorms over ``qk`` [..., heads + kv_heads, D] (queries then keys): each head normalised over
        its D, the query heads scaled by ``q_norm``'s weight and the key heads by ``k_norm``'s."""
        dim = qk.shape[-1]
        weight = torch.cat((attention.q_norm.weight.expand(heads, dim), attention.k_norm.weight.expand(kv_heads, dim)))
        if qk.dtype == torch.float32:
            return F.rms_norm(qk, (dim,), None, self.eps) * weight
        return weight * F.rms_norm(qk.float(), (dim,), None, self.eps).to(qk.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE as ``x·cos + roll(x, D/2)·sin`` with the signed ``sin`` of :meth:`_rope_tables` (``rotate_half``
        folded into its sign): no slicing, negating and concatenating of ``x``, and the same products and sum as
        HF's ``x·cos + rotate_half(x)·sin``, so the same rounding."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin

    def _layer(self, layer: _DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """One decoder layer over whole sequences (no cache; gradients flow)."""
        rows, width, _ = h.shape
        attention = layer.self_attn
        x = self._norm(h, layer.input_layernorm)
        q = F.linear(x, attention.q_proj.weight, attention.q_proj.bias).view(rows, width, -1, self.head_dim)
        k = F.linear(x, attention.k_proj.weight, attention.k_proj.bias).view(rows, width, -1, self.head_dim)
        v = F.linear(x, attention.v_proj.weight, attention.v_proj.bias).view(rows, width, -1, self.head_dim)
        if self.qk_norm:
            q, k = self._norm(q, attention.q_norm), self._norm(k, attention.k_norm)
        q = self._rope(q.transpose(1, 2), cos, sin)
        k = self._rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        out = _attend(q, k, v, mask, self.num_kv_heads != self.num_heads)
        h = h + F.linear(out.transpose(1, 2).reshape(rows, width, -1), attention.o_proj.weight, attention.o_proj.bias)
        mlp = layer.mlp
        x = self._norm(h, layer.post_attention_layernorm)
        gate = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        return h + F.linear(gate * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                            mlp.down_proj.bias)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        backbone = self._hf.model
        h = F.embedding(input_ids, backbone.embed_tokens.weight)
        cos = self._cos[positions].unsqueeze(1).to(h.dtype)
        sin = self._sin[positions].unsqueeze(1).to(h.dtype)
        for layer in self.layers:
            h = self._layer(layer, h, cos, sin, mask)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self._hf.lm_head
        return F.linear(self._norm(h, self._hf.model.norm), head.weight, head.bias)

    def _rope_tables(self, length: int, device: torch.device) -> None:
        if self._cos.shape[0] >= length and self._cos.device == device:
            return
        with torch.inference_mode(False):  # kept across calls: ordinary tensors even when made during generation
            reference = torch.empty(0, dtype=torch.float32, device=device)
            rotary = self._hf.model.rotary_emb
            cos, sin = rotary(reference, torch.arange(length, device=device).unsqueeze(0))
            half = sin.shape[-1] // 2  # sin stored signed: its first half negated (rotate_half folded in)
            self._cos, self._sin = cos[0].clone(), torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

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
        h = self._hidden(input_ids, position_ids, self._prompt_mask(attention_mask.bool()))
        return self._logits(h if last is None else h[:, -last:])

    def response_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                        response_width: int, *, remove_padding: bool = False,
                        valid_only: bool = False) -> torch.Tensor:
        """Logits [B, R, V] predicting each of the last ``response_width`` tokens (gradients flow).

        Rows that repeat the previous row's prompt (the n samples of one prompt, as rollouts produce them) share
        one forward of that prompt: the prompt columns are computed once per distinct prompt and the responses
        attend to its keys/values — the same logits and gradients as the full forward, with the prompt's
        arithmetic done once instead of n times.

        ``remove_padding`` (the engine's ``use_remove_padding``): the linear layers, norms and RoPE run on the valid
        tokens only (padding is scattered in for the batched attention alone), the LM head only at the positions
        that predict a valid response token; logits at padding positions are 0. Without it and without repeated
        prompts this is :meth:`forward_logits`. ``valid_only``: logits [M, V] of the M valid response tokens alone
        (row-major order of ``attention_mask[:, -R:]``), no [B, R, V] grid (at a real vocabulary, the padding's
        share of that grid is gigabytes).
        """
        prompt_width = input_ids.shape[1] - response_width
        firsts = distinct_prompt_rows(input_ids[:, :prompt_width], attention_mask[:, :prompt_width],
                                       position_ids[:, :prompt_width]) if prompt_width > 0 else None
        if firsts is None and remove_padding and prompt_width > 0:  # every row its own prompt
            every = torch.arange(input_ids.shape[0], device=input_ids.device)
            firsts = (every, every)
        if firsts is None:
            logits = self.forward_logits(input_ids, attention_mask, position_ids, last=response_width + 1)[:, :-1]
            return logits[attention_mask[:, prompt_width:].bool()] if valid_only else logits
        unique_rows, owner = firsts
        return self._shared_prefix_logits(input_ids, attention_mask, position_ids, prompt_width, unique_rows, owner,
                                          remove_padding=remove_padding or valid_only, valid_only=valid_only)

    def _shared_prefix_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              position_ids: torch.Tensor, prompt_width: int, unique_rows: torch.Tensor,
                              owner: torch.Tensor, *, remove_padding: bool = False,
                              valid_only: bool = False) -> torch.Tensor:
        rows, width = input_ids.shape
        prompts, responses = len(unique_rows), width - prompt_width
        device = input_ids.device
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        self._rope_tables(int(position_ids.max()) + 1, device)
        prompt_tokens = prompts * prompt_width
        total = prompt_tokens + rows * responses
        # one flat token stream: the distinct prompts' tokens, then every row's response tokens
        ids = torch.cat((input_ids[unique_rows, :prompt_width].reshape(-1), input_ids[:, prompt_width:].reshape(-1)))
        positions = torch.cat((position_ids[unique_rows, :prompt_width].reshape(-1),
                               position_ids[:, prompt_width:].reshape(-1)))
        keys = attention_mask.bool()
        prompt_keys = keys[unique_rows, :prompt_width]
        # with padding removal, the stream keeps its valid tokens only (``kept``: their indices in the full stream)
        kept: torch.Tensor | None = None
        if remove_padding:
            valid = torch.cat((prompt_keys.reshape(-1), keys[:, prompt_width:].reshape(-1)))
            if not bool(valid.all()):
                kept = valid.nonzero().squeeze(1)
                ids, positions = ids[kept], positions[kept]
        embedding = self._hf.model.embed_tokens.weight
        h = F.embedding(ids, embedding)
        cos = self._cos[positions].unsqueeze(1).to(h.dtype)  # [N, 1, D]
        sin = self._sin[positions].unsqueeze(1).to(h.dtype)
        prompt_mask = self._prompt_mask(prompt_keys)  # [U, 1, P, P]
        causal = torch.ones(responses, responses, dtype=torch.bool, device=device).tril()
        response_mask = torch.cat((keys[:, None, None, :prompt_width].expand(rows, 1, responses, prompt_width),
                                   (causal & keys[:, None, None, prompt_width:])
                                   | torch.eye(responses, dtype=torch.bool, device=device)), dim=-1)
        gqa = kv_heads != heads
        # padding removed from responses of different lengths: attention by groups of rows of similar length, each
        # over its own width (a padded [B, R] attention costs B·R·(P + R) whatever the rows hold)
        buckets = _response_buckets(keys[:, prompt_width:], owner, response_mask, prompt_width) if kept is not None \
            else None
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            x = self._norm(h, layer.input_layernorm)
            biases = [m.bias for m in (attention.q_proj, attention.k_proj, attention.v_proj) if m.bias is not None]
            qkv = F.linear(x, torch.cat((attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)),
                           torch.cat(biases) if biases else None)
            # split (one backward cat per split) rather than slices (a zero-filled gradient per slice)
            qk, v = torch.split(qkv, [(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
            qk = qk.view(-1, heads + kv_heads, dim)
            if self.qk_norm:
                qk = self._head_norm(qk, attention, heads, kv_heads)
            qk = self._rope(qk, cos, sin)
            if kept is not None:  # padding back in for the batched attention (zeros: masked keys, unused queries)
                qk = qk.new_zeros(total, heads + kv_heads, dim).index_copy(0, kept, qk)
                v = v.new_zeros(total, kv_heads * dim).index_copy(0, kept, v)
            qk_p, qk_r = torch.split(qk, [prompt_tokens, rows * responses])
            v_p, v_r = torch.split(v, [prompt_tokens, rows * responses])
            q_p, k_p = torch.split(qk_p, [heads, kv_heads], dim=1)
            q_r, k_r = torch.split(qk_r, [heads, kv_heads], dim=1)
            q_p = q_p.view(prompts, prompt_width, heads, dim).transpose(1, 2)
            k_p = k_p.view(prompts, prompt_width, kv_heads, dim).transpose(1, 2)
            v_p = v_p.view(prompts, prompt_width, kv_heads, dim).transpose(1, 2)
            q_r = q_r.view(rows, responses, heads, dim).transpose(1, 2)
            k_r = k_r.view(rows, responses, kv_heads, dim).transpose(1, 2)
            v_r = v_r.view(rows, responses, kv_heads, dim).transpose(1, 2)
            out_p = _attend(q_p, k_p, v_p, prompt_mask, gqa)
            if buckets is None:
                out_r = _attend(q_r, torch.cat((k_p[owner], k_r), dim=2), torch.cat((v_p[owner], v_r), dim=2),
                                response_mask, gqa).transpose(1, 2).reshape(rows * responses, heads * dim)
            else:
                parts = [_attend(q_r[members, :, :width],
                                 torch.cat((k_p[owners], k_r[members, :, :width]), dim=2),
                                 torch.cat((v_p[owners], v_r[members, :, :width]), dim=2), mask, gqa)
                         .transpose(1, 2).reshape(-1, heads * dim)
                         for members, owners, width, mask in buckets.groups]
                out_r = parts[0].new_zeros(rows * responses, heads * dim).index_copy(0, buckets.slots,
                                                                                    torch.cat(parts))
            out = torch.cat((out_p.transpose(1, 2).reshape(prompt_tokens, heads * dim), out_r))
            if kept is not None:
                out = out.index_select(0, kept)
            h = h + F.linear(out, attention.o_proj.weight, attention.o_proj.bias)
            x = self._norm(h, layer.post_attention_layernorm)
            # two matmuls, not one over [gate; up] then chunk: contiguous halves make silu and its backward faster
            gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h = h + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        if remove_padding:
            return self._valid_response_logits(h, keys[:, prompt_width:], owner, prompt_width, kept, total,
                                               valid_only=valid_only)
        # the last prompt position predicts the first response token; response positions predict the rest
        h_p, h_r = torch.split(h, [prompt_tokens, rows * responses])
        first = self._logits(h_p.view(prompts, prompt_width, -1)[:, -1])[owner].unsqueeze(1)
        rest = self._logits(h_r.view(rows, responses, -1)[:, :-1])
        return torch.cat((first, rest), dim=1)

    def _valid_response_logits(self, h: torch.Tensor, response_keys: torch.Tensor, owner: torch.Tensor,
                               prompt_width: int, kept: torch.Tensor | None, total: int, *,
                               valid_only: bool = False) -> torch.Tensor:
        """Logits [B, R, V] from the LM head run only where a valid response token is predicted (0 elsewhere; with
        ``valid_only`` those [M, V] alone).

        ``h`` holds the stream's tokens (the valid ones when ``kept``); the predictor of response token j of row r
        is the last position of its prompt (j = 0) or its response position j - 1."""
        rows, responses = response_keys.shape
        device = h.device
        prompt_tokens = total - rows * responses
        predictor = torch.empty(rows, responses, dtype=torch.long, device=device)
        predictor[:, 0] = owner * prompt_width + prompt_width - 1
        predictor[:, 1:] = (prompt_tokens + torch.arange(rows, device=device)[:, None] * responses
                            + torch.arange(responses - 1, device=device))
        index = predictor[response_keys]  # row-major, as index_put fills response_keys below
        if kept is not None:  # full-stream indices → the kept stream's (predictors of valid tokens are valid)
            where = torch.full((total,), -1, dtype=torch.long, device=device)
            where[kept] = torch.arange(len(kept), device=device)
            index = where[index]
            if bool((index < 0).any()):
                raise ValueError("a valid response token whose predicting position is padding: the lean forward "
                                 "expects left-padded prompts followed by right-padded responses")
        logits = self._logits(h.index_select(0, index))
        if valid_only:
            return logits
        # not a view of the scattered logits (an FSDP forward method must not return views)
        return logits.new_zeros(rows, responses, logits.shape[-1]).index_put((response_keys,), logits)


class _Buckets(NamedTuple):
    """Groups of response rows attended together: (rows, their prompts' rows, width, mask) each, and ``slots``: the
    flat [B·R] index of every (row, column) the groups compute, in their order."""

    groups: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]
    slots: torch.Tensor


def _response_buckets(response_keys: torch.Tensor, owner: torch.Tensor, mask: torch.Tensor, prompt_width: int,
                      *, most: int = 8, keep_above: float = 0.8) -> _Buckets | None:
    """Rows sorted by valid response length in up to ``most`` equal-count groups, a group merged into the longer one
    before it when its longest row is at least ``keep_above`` of that one's (too little to save for another call);
    None when one group spans the whole width (nothing to save)."""
    rows, responses = response_keys.shape
    lengths = response_keys.sum(1)
    order = torch.argsort(lengths, descending=True, stable=True)
    longest = lengths[order].tolist()
    cuts = sorted({round(rows * i / most) for i in range(1, most)} - {0, rows}) + [rows]
    spans: list[list[int]] = []
    start = 0
    for end in cuts:
        if spans and longest[start] >= keep_above * longest[spans[-1][0]]:
            spans[-1][1] = end
        else:
            spans.append([start, end])
        start = end
    if len(spans) == 1 and longest[0] == responses:
        return None
    groups, slots = [], []
    for start, end in spans:
        members = order[start:end]
        width = max(1, int(longest[start]))
        groups.append((members, owner[members], width, mask[members, :, :width, :prompt_width + width]))
        slots.append((members[:, None] * responses + torch.arange(width, device=members.device)).reshape(-1))
    return _Buckets(groups, torch.cat(slots))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: bool) -> torch.Tensor:
    if upcast_for_backward(q):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=gqa).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def upcast_for_backward(query: torch.Tensor) -> bool:
    """Whether attention runs in fp32 on half-precision inputs: on CPU, where autograd will run its backward.

    torch's CPU flash-attention backward in bf16 is 4-10x slower than in fp32 at rollout shapes (6-64 rows of 10-60
    tokens, 8 heads of 64; ``bench/mixed_precision.py``'s ``attention`` rows) while the bf16 forward is as fast or
    faster, so the no-grad passes (log-probs, generation) stay in bf16 and the training forward's attention upcasts
    (its output is cast back: the rest of the layer stays in the compute dtype).
    """
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
            and torch.is_grad_enabled() and query.requires_grad)
