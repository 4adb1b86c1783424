"""KV-cache reuse across turns in the hf engine (capability ``kv_cache_reuse``): a conversation continued from ids
that extend what the engine computed for it last prefills only the appended ids, with the same logits and the same
greedy tokens as a full re-prefill; entries are freed when asked, on new weights and under a memory cap."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TokenCompletion
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow_fsdp.kv_reuse import ConversationKVCache, common_prefix_length
from hybridflow_fsdp.models import compute_position_ids
from hybridflow_fsdp.rollout import HFRolloutEngine

VOCAB, PAD, EOS = 300, 0, 1
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def _engine(**extra: Any) -> HFRolloutEngine:
    model = {**tiny_model_config(max_position_embeddings=1024), "vocab_size": VOCAB, "pad_token_id": PAD,
             "eos_token_id": EOS, "bos_token_id": None}
    return HFRolloutEngine(config=RolloutEngineConfig(
        model=ModelSpec(config=model, seed=3), max_prompt_length=512, max_new_tokens=16, pad_token_id=PAD,
        eos_token_id=EOS, extra=extra))


@pytest.fixture(scope="module")
def engines() -> tuple[HFRolloutEngine, HFRolloutEngine]:
    """The same weights twice: with reuse (the default) and with ``kv_cache_reuse: false`` (full re-prefill)."""
    reuse, full = _engine(), _engine(kv_cache_reuse=False)
    assert "kv_cache_reuse" in reuse.capabilities and "kv_cache_reuse" not in full.capabilities
    return reuse, full


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(7, VOCAB) for _ in range(n)]


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def test_continued_prefill_logits_equal_a_full_prefill(engines: tuple[HFRolloutEngine, HFRolloutEngine]) -> None:
    """Decoder level: prefilling prefixes, keeping their keys/values and prefilling only the rest gives the logits
    (every vocabulary entry) of one prefill of the whole sequences."""
    decoder = engines[0].decoder
    assert decoder is not None
    rng = random.Random(0)
    prefixes = [_ids(rng, n) for n in (4, 19, 11, 1)]
    full = [p + _ids(rng, n) for p, n in zip(prefixes, (7, 1, 13, 5))]
    cache = ConversationKVCache(max_bytes=1 << 30)
    with torch.inference_mode():
        ids, mask = _left_pad(full)
        expected = decoder.prefill(ids, mask, compute_position_ids(mask), 0)
        ids, mask = _left_pad(prefixes)
        decoder.prefill(ids, mask, compute_position_ids(mask), 0)
        cache.store(range(4), prefixes, [()] * 4, decoder)
        past, reused = cache.take(range(4), full, device=ids.device, dtype=torch.float32)
        assert past is not None and reused == [len(p) for p in prefixes]
        ids, mask = _left_pad([f[len(p):] for f, p in zip(full, prefixes)])
        got = decoder.prefill(ids, mask, compute_position_ids(mask) + past.lengths[:, None], 0, past=past)
        decoder.release()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert cache.stats["prefill_tokens"] == sum(len(f) - len(p) for f, p in zip(full, prefixes))


def _same(a: list[TokenCompletion], b: list[TokenCompletion]) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.log_probs), torch.tensor(y.log_probs), atol=1e-5, rtol=0)


def test_multi_turn_reuse_matches_a_full_reprefill_and_prefills_only_appended_ids(
        engines: tuple[HFRolloutEngine, HFRolloutEngine]) -> None:
    """Four greedy turns over variable-length conversations (some stop early at a stop id, a new conversation joins
    at turn 2): the same tokens and log-probs as re-prefilling everything, and each continued row prefills exactly
    its appended ids plus its last sampled id when decoding never fed it back (the batch's longest turn)."""
    reuse, full = engines
    reuse.release_cache()
    rng = random.Random(1)
    prefixes = [_ids(rng, n) for n in (3, 17, 9, 30, 5)]
    keys: list[Any] = [("c", i) for i in range(len(prefixes))]
    first = full.generate_from_tokens(prefixes, GREEDY)
    stop = (first[0].token_ids[3], first[2].token_ids[5])  # rows 0 and 2 stop early
    early, kept = 0, [0] * len(prefixes)
    for turn in range(4):
        before = reuse.kv_cache_stats
        got = reuse.generate_from_tokens(prefixes, GREEDY, stop_token_ids=stop, cache_keys=keys)
        _same(got, full.generate_from_tokens(prefixes, GREEDY, stop_token_ids=stop))
        after = reuse.kv_cache_stats
        if turn:
            # continued rows: the appended ids (+ the uncached last id); the joining row: all of its ids
            expected = sum(len(prefixes[i]) - kept[i] for i in range(len(prefixes)))
            assert after["prefill_tokens"] - before["prefill_tokens"] == expected
            assert after["reused_tokens"] - before["reused_tokens"] == sum(kept)
            assert after["reused_tokens"] - before["reused_tokens"] > 2 * expected  # reuse is most of it
        longest = max(len(c.token_ids) for c in got)
        early += sum(len(c.token_ids) < longest for c in got)
        appended = [_ids(rng, rng.randint(1, 12)) for _ in prefixes]
        kept = [len(p) + len(c.token_ids) - (len(c.token_ids) == longest) for p, c in zip(prefixes, got)]
        prefixes = [p + list(c.token_ids) + t for p, c, t in zip(prefixes, got, appended)]
        if turn == 1:
            prefixes.append(_ids(rng, 6))
            keys.append(("c", "new"))
            kept.append(0)
    assert early >= 2, "want rows that stopped before the batch's last step (all their ids fed back)"
    assert reuse.kv_cache_stats["entries"] == len(keys)
    reuse.release_cache(keys[:2])
    assert reuse.kv_cache_stats["entries"] == len(keys) - 2


def test_diverging_prefix_reuses_only_the_common_part(engines: tuple[HFRolloutEngine, HFRolloutEngine]) -> None:
    """A key continued with ids that do not extend its entry (a turn cut short, another sequence) reuses only the
    common prefix; a prefix equal to the kept ids still prefills its last id."""
    reuse, full = engines
    reuse.release_cache()
    rng = random.Random(2)
    prefixes = [_ids(rng, 12), _ids(rng, 8)]
    got = reuse.generate_from_tokens(prefixes, GREEDY, cache_keys=["a", "b"])
    cut = [prefixes[0][:7] + _ids(rng, 4), prefixes[1] + list(got[1].token_ids[:-1])]
    before = reuse.kv_cache_stats
    _same(reuse.generate_from_tokens(cut, GREEDY, cache_keys=["a", "b"]), full.generate_from_tokens(cut, GREEDY))
    after = reuse.kv_cache_stats
    assert after["reused_tokens"] - before["reused_tokens"] == 7 + len(cut[1]) - 1
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 2
    with pytest.raises(ValueError, match="same cache key twice"):
        reuse.generate_from_tokens(prefixes, GREEDY, cache_keys=["a", "a"])


def test_entries_are_dropped_on_new_weights_sleep_and_over_the_cap(
        engines: tuple[HFRolloutEngine, HFRolloutEngine]) -> None:
    reuse, full = engines
    reuse.release_cache()
    rng = random.Random(3)
    prefixes = [_ids(rng, 10) for _ in range(3)]
    reuse.generate_from_tokens(prefixes, GREEDY, cache_keys=[0, 1, 2])
    assert reuse.kv_cache_stats["entries"] == 3 and reuse.kv_cache_stats["held_bytes"] > 0
    weights = {name: p.detach().clone() for name, p in reuse.model.named_parameters()}
    reuse.update_weights(weights.items(), version=1)  # keys/values of the old weights must not be reused
    assert reuse.kv_cache_stats["entries"] == 0 and reuse.kv_cache_stats["held_bytes"] == 0
    reuse.generate_from_tokens(prefixes, GREEDY, cache_keys=[0, 1, 2])
    reuse.sleep()
    assert reuse.kv_cache_stats["entries"] == 0
    reuse.wake()
    reuse.update_weights(weights.items(), version=2)
    capped = _engine(kv_cache_max_bytes=1)  # every entry is over the cap: stored, then evicted
    got = capped.generate_from_tokens(prefixes, GREEDY, cache_keys=[0, 1, 2])
    assert capped.kv_cache_stats["evicted"] == 3 and capped.kv_cache_stats["entries"] == 0
    longer = [p + list(c.token_ids) for p, c in zip(prefixes, got)]
    _same(capped.generate_from_tokens(longer, GREEDY, cache_keys=[0, 1, 2]), full.generate_from_tokens(longer, GREEDY))
    assert capped.kv_cache_stats["reused_tokens"] == 0
