"""Megatron (t = 2, d = 1) → generation tg = 1 and tg = 2 with ``park=True``, the actor worker's path: while the
generation shards are held a rank holds every weight once — resident weight bytes, counted from storages, are the
generation shards alone (M at tg = 1, M/2 + the replicated norms' other half at tg = 2; never M/2 + M) — and
``end_generation()`` (or the next forward, or a train step) gives the training parameters their storage back bit for
bit (one 2-process gloo run, two models)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = [pytest.mark.megatron, pytest.mark.slow]  # one 2-rank run of two models (~35 CPU-seconds)

BUCKET_BYTES = 64 << 10
CASES = [  # vocab 64: a multiple of 8·t, so megatron pads nothing and the planner path runs
    # 1 kv group per tensor rank: at tg = t every generation shard is a view of megatron's (nothing to park)
    {"model": {"architecture": "qwen2", "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": True}},
    # 2 kv groups per tensor rank: q/k/v are strided rows of megatron's interleaved qkv, so they are copies at
    # tg = t, and the DDP param buffer is parked (its views made copies) to hold each weight once
    {"model": {"architecture": "llama", "num_heads": 4, "num_kv_heads": 4, "tie_word_embeddings": False}},
]
IDS = ["qwen2_tied_kv2", "llama_kv4"]


@pytest.fixture(scope="module")  # one 2-rank run for every test here
def parked(module_ranks):
    args = {"cases": CASES, "tp": 2, "tensors": [1, 2], "config": {"vocab_size": 64}, "micro_batch_size": 1,
            "extra": {"handover_bucket_bytes": BUCKET_BYTES}}
    results = module_ranks("park", 2, args, timeout_s=360)
    return [[result["cases"][index] for result in results] for index in range(len(CASES))]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_tg1_holds_the_full_model_once_and_restores_bit_for_bit(parked, case):
    for rank, result in enumerate(parked[case]):
        model, training = result["model_bytes"], result["training_bytes"]
        assert model // 2 <= training < model, (rank, result)  # megatron's shard (its DDP buffer, padded)
        one = result[1]
        stats, plain = one["stats"], one["plain"]
        assert one["names_equal"] and one["mismatched"] == [], (rank, one["mismatched"][:4])
        assert stats.bytes_received == stats.lower_bound_bytes == plain.bytes_received > 0, stats
        # the whole DDP param buffer went into the full generation weights; what is resident is those alone: M,
        # where the handover without park holds M/2 (training) + M
        assert stats.parked_bytes == training and one["parked_training_bytes"] == 0, (rank, stats)
        assert one["generation_bytes"] == one["target_bytes"] == model, (rank, one)
        assert one["generation_bytes"] <= model + one["bucket"]  # M/(tg·pg) + one bucket
        assert one["restored_equal"] and one["restored_bytes"] == training, (rank, one)
        assert one["forward_after_park_equal"] and one["after_forward_equal"], rank


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_tg2_holds_megatrons_shards_once(parked, case):
    for rank, result in enumerate(parked[case]):
        model, training, held = result["model_bytes"], result["training_bytes"], result["held_bytes"]
        two = result[2]
        stats = two["stats"]
        # megatron's shard is tg's: M/2, the replicated norms whole (their other half: a few hundred bytes)
        assert model // 2 < held == two["target_bytes"] < model // 2 + two["bucket"], (rank, result)
        assert two["names_equal"] and two["mismatched"] == [], (rank, two["mismatched"][:4])
        assert stats.bytes_received == stats.lower_bound_bytes == 0, stats  # t = tg: megatron's shards are tg's
        if CASES[case]["model"]["num_kv_heads"] == 2:  # every generation shard a view: nothing to park, no copy
            assert stats.aliased_bytes == held and stats.parked_bytes == 0, stats
            assert two["generation_bytes"] == training, (rank, two)
        else:  # q/k/v copied out: the buffer parks (the views became copies), the generation shards stay alone
            assert stats.aliased_bytes < held and stats.parked_bytes == training, stats
            assert two["parked_training_bytes"] == 0 and two["generation_bytes"] == held, (rank, two)
        assert two["generation_bytes"] <= model // 2 + two["bucket"]  # M/(tg·pg) + one bucket
        assert two["restored_equal"] and two["restored_bytes"] == training, (rank, two)
        assert two["forward_after_park_equal"] and two["after_forward_equal"], rank


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_a_train_step_after_a_park_restores_first(parked, case):
    for result in parked[case]:
        assert result["stepped"] and result["stepped_bytes"] == result["training_bytes"]
