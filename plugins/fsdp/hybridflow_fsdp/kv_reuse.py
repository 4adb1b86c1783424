"""Keys/values kept across ``generate_from_tokens`` calls (the ``hf`` engine's capability ``kv_cache_reuse``).

A multi-turn conversation is continued turn after turn from its whole id list; the engine keeps, per caller key, the
keys/values of the ids it last computed for that conversation and, when the next call's prefix extends them, the
lean decoder prefills only the new ids (the tool turn, and the last sampled id, which decoding never fed back) and
attends to the kept ones. Entries are matched by their ids, not trusted: only the longest common prefix of the kept
ids and the new prefix is reused (at most all but its last id, whose logits start the turn), so a key reused for
another sequence costs a full prefill, never a wrong token. Stability: internal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # fast_decode imports this module (PastKV, write_past) at run time
    from hybridflow_fsdp.fast_decode import LeanDecoder

__all__ = ["ConversationKVCache", "PastKV", "common_prefix_length", "write_past"]


@dataclass(frozen=True, slots=True)
class PastKV:
    """Keys (post-RoPE) and values of tokens an earlier call computed, for :meth:`LeanDecoder.prefill` to continue
    from: ``kv`` [layers, 2, B, KV, P, D] and ``keys`` [B, P] (True where a slot holds a token; a row's tokens are
    right-aligned, in order, so ``keys[r].sum()`` is the position its next token takes)."""

    kv: torch.Tensor
    keys: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.keys.sum(-1)


def write_past(past: PastKV, k: list[torch.Tensor], v: list[torch.Tensor], keys: torch.Tensor,
               prompt_mask: torch.Tensor) -> torch.Tensor:
    """Prefill from the cache: ``past``'s keys/values into slots ``[0, P)`` of each layer's cache ``k``/``v``
    [B, KV, T, D] and its key mask into ``keys`` [B, T]; returns the new ids' attention mask [B, 1, W, P + W]
    (``prompt_mask`` [B, 1, W, W] over the new ids, behind the past keys every new id sees)."""
    rows, width, past_width = prompt_mask.shape[0], prompt_mask.shape[2], past.keys.shape[1]
    for index in range(len(k)):
        k[index][:, :, :past_width] = past.kv[index, 0]
        v[index][:, :, :past_width] = past.kv[index, 1]
    keys[:, :past_width] = past.keys
    return torch.cat((past.keys[:, None, None, :].expand(rows, 1, width, past_width), prompt_mask), -1)


@dataclass(slots=True)
class _Entry:
    ids: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, KV, T, D]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]: bisect on the first mismatch
    while high - low > 1:
        middle = (low + high) // 2
        if tuple(a[low:middle]) == tuple(b[low:middle]):
            low = middle
        else:
            high = middle
    return low


class ConversationKVCache:
    """Per-key keys/values of the ids an engine computed last (its memory bounded by ``max_bytes``: the entries
    stored longest ago are dropped first; a dropped entry only costs a full prefill).

    ``stats`` counts, over every call: ``prefill_tokens`` (ids the model computed in prefills), ``reused_tokens``
    (ids whose keys/values came from an entry instead), ``hits`` / ``misses`` (rows that did / did not reuse any)
    and ``evicted`` entries.
    """

    def __init__(self, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._bytes = 0
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "hits": 0, "misses": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def _pop(self, key: Hashable) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry

    def release(self, keys: Iterable[Hashable] | None = None) -> None:
        """Drop the entries of ``keys`` (all when None); unknown keys are ignored."""
        if keys is None:
            self._entries.clear()
            self._bytes = 0
            return
        for key in keys:
            self._pop(key)

    def take(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], *, device: torch.device,
             dtype: torch.dtype) -> tuple[PastKV | None, list[int]]:
        """Remove the entries of ``keys`` and lay out what each row reuses (right-aligned, as
        :meth:`LeanDecoder.prefill` reads it); the reused id count per row. Rows without an entry reuse 0."""
        if len(set(keys)) != len(keys):
            raise ValueError("generate_from_tokens got the same cache key twice in one call; one key per conversation")
        entries = [self._pop(key) for key in keys]
        reused = [0 if entry is None else min(common_prefix_length(entry.ids, prompt), len(prompt) - 1)
                  for entry, prompt in zip(entries, prompts)]
        self.stats["hits"] += sum(1 for n in reused if n > 0)
        self.stats["misses"] += sum(1 for n in reused if n == 0)
        self.stats["reused_tokens"] += sum(reused)
        self.stats["prefill_tokens"] += sum(len(prompt) - n for prompt, n in zip(prompts, reused))
        width = max(reused)
        if width == 0:
            return None, reused
        layers, _, kv_heads, _, dim = next(e.kv.shape for e in entries if e is not None)
        kv = torch.zeros(layers, 2, len(prompts), kv_heads, width, dim, dtype=dtype, device=device)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
        for row, (entry, n) in enumerate(zip(entries, reused)):
            if entry is not None and n:
                kv[:, :, row, :, width - n:] = entry.kv[:, :, :, :n]
                mask[row, width - n:] = True
        return PastKV(kv=kv, keys=mask), reused

    def store(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], generated: Sequence[Sequence[int]],
              decoder: LeanDecoder) -> None:
        """Keep, per key, the keys/values the decoder computed for its row: the prefix's and those of the
        generated ids that decoding fed back (every one but a row's last, when it was sampled at the last step)."""
        k, v, mask, prefill_width = decoder.cache_state()
        steps = mask.shape[1] - prefill_width  # ids fed back by decode steps, every row alike
        for row, (key, prompt, ids) in enumerate(zip(keys, prompts, generated)):
            fed = min(len(ids), steps)
            slots = torch.cat((mask[row, :prefill_width].nonzero().squeeze(1),
                               torch.arange(prefill_width, prefill_width + fed, device=mask.device)))
            # only the row's slots are copied (no copy of the whole batch's cache)
            kv = torch.stack([torch.stack((k_layer[row].index_select(1, slots), v_layer[row].index_select(1, slots)))
                              for k_layer, v_layer in zip(k, v)])
            entry = _Entry(ids=(*(int(t) for t in prompt), *(int(t) for t in ids[:fed])), kv=kv)
            if len(entry.ids) != len(slots):
                raise AssertionError(f"kept {len(slots)} cache slots for {len(entry.ids)} ids")
            self._pop(key)
            self._entries[key] = entry
            self._bytes += entry.nbytes
        while self._bytes > self.max_bytes and self._entries:
            self._pop(next(iter(self._entries)))
            self.stats["evicted"] += 1
