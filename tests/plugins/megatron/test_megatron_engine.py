"""The megatron engine on CPU (gloo): HF-equal logits, TP/PP/DP train steps equal to one rank, roles and errors; the
train → generate handover through the core reshard planner: (p, t, d) = (1, 2, 2) and (2, 2, 1) → tg = 1 receive
exactly the per-rank lower bound and yield the HF weights bit for bit; and (t = 2, d = 1) → tg = 1 and tg = 2 with
``park=True``, the actor worker's path: while the generation shards are held a rank holds every weight once — resident
weight bytes, counted from storages, are the generation shards alone (M at tg = 1, M/2 + the replicated norms' other
half at tg = 2; never M/2 + M) — and ``end_generation()`` (or the next forward, or a train step) gives the training
parameters their storage back bit for bit. (p, t, d) = (2, 2, 1) with tied embeddings parks on both pipeline stages
at tg = 1, 2 and 4 (the last stage's output-layer copy parked in the embedding's generation shard; at tg = 4 the
cells held only by other ranks fetched back), and its next train step equals an unparked run bit for bit.

Every run of one world size goes through one group of processes (megatron imported once per rank), a case each: one
1-rank, one 2-rank and one 4-rank group for the whole module."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron

GQA = {"num_heads": 4, "num_kv_heads": 2}  # head 16, 2 query groups: tensor parallel 2 splits the groups
ARCHITECTURES = ("qwen2", "llama")
TRAIN = {"scenario": "train", "model": {"architecture": "qwen2", **GQA}, "steps": 2, "micro_batch_size": 2}
ONE_RANK = [*({"scenario": "logits", "model": {"architecture": architecture, **GQA,
                                               "tie_word_embeddings": architecture == "qwen2"}}
              for architecture in ARCHITECTURES),
            TRAIN, {**TRAIN, "entropy_coef": 0.0, "steps": 1}]
BUCKET_BYTES = 64 << 10  # several buckets for the ~330 KB test model, so the peak bounds below say something
PARK = [  # vocab 64: a multiple of 8·t, so megatron pads nothing and the planner path runs
    # 1 kv group per tensor rank: at tg = t every generation shard is a view of megatron's (nothing to park)
    {"model": {"architecture": "qwen2", "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": True}},
    # 2 kv groups per tensor rank: q/k/v are strided rows of megatron's interleaved qkv, so they are copies at
    # tg = t, and the DDP param buffer is parked (its views made copies) to hold each weight once
    {"model": {"architecture": "llama", "num_heads": 4, "num_kv_heads": 4, "tie_word_embeddings": False}},
]
PARK_IDS = ["qwen2_tied_kv2", "llama_kv4"]
TWO_RANKS = [{"scenario": "logits", "model": {"architecture": "qwen2", **GQA}, "tp": 2},
             {**TRAIN, "tp": 2}, {**TRAIN, "pp": 2},
             {"scenario": "park", "cases": PARK, "tp": 2, "tensors": [1, 2], "config": {"vocab_size": 64},
              "micro_batch_size": 1, "extra": {"handover_bucket_bytes": BUCKET_BYTES}},
             # qwen3: its q/k norms (replicated) over each rank's heads
             {"scenario": "logits", "model": {"architecture": "qwen3", **GQA, "tie_word_embeddings": False}, "tp": 2}]
HANDOVER = [  # vocab 64: a multiple of 8·t, so megatron pads nothing and the planner path runs
    {"pp": 1, "tp": 2, "model": {"architecture": "llama", "num_heads": 4, "num_kv_heads": 2,
                                 "tie_word_embeddings": False}},
    {"pp": 2, "tp": 2, "model": {"architecture": "qwen2", "num_heads": 4, "num_kv_heads": 2,
                                 "tie_word_embeddings": True}},
]
HANDOVER_IDS = ["p1t2d2_llama", "p2t2d1_qwen2_tied"]
# (p, t, d) = (2, 2, 1), tied embeddings: the last stage's DDP buffer also holds the embedding's output-layer copy;
# tg = 4 does not divide t, so each rank's training shard lies half in other ranks' generation shards
PARK_STEPS = {"scenario": "park_steps", "pp": 2, "tp": 2, "tensors": [1, 2, 4], "micro_batch_size": 1,
              "config": {"vocab_size": 64}, "extra": {"handover_bucket_bytes": BUCKET_BYTES},
              "model": {"architecture": "qwen2", **GQA, "tie_word_embeddings": True}}
FOUR_RANKS = [{"scenario": "handover", "cases": HANDOVER, "config": {"vocab_size": 64},
               "extra": {"handover_bucket_bytes": BUCKET_BYTES}, "micro_batch_size": 1},
              {**TRAIN, "tp": 2}, {**PARK_STEPS, "park": True}, {**PARK_STEPS, "park": False}]


@pytest.fixture(scope="module")
def one_rank(module_ranks):
    (result,) = module_ranks("cases", 1, {"cases": ONE_RANK}, timeout_s=960)
    return result["cases"]


@pytest.fixture(scope="module")
def two_ranks(module_ranks):
    results = module_ranks("cases", 2, {"cases": TWO_RANKS}, timeout_s=900)
    return [[result["cases"][index] for result in results] for index in range(len(TWO_RANKS))]


@pytest.fixture(scope="module")
def parked(two_ranks):
    """The park cases' results per case per rank."""
    return [[result["cases"][index] for result in two_ranks[3]] for index in range(len(PARK))]


@pytest.fixture(scope="module")
def four_ranks(module_ranks):
    """Rank order: ``[handover results per case per rank, tp2 dp2 train results per rank, p2 t2 park results per
    rank, the same unparked]``."""
    results = module_ranks("cases", 4, {"cases": FOUR_RANKS}, timeout_s=600)
    handover = [[result["cases"][0]["cases"][index] for result in results] for index in range(len(HANDOVER))]
    return handover, *([result["cases"][index] for result in results] for index in (1, 2, 3))


@pytest.fixture(scope="module")
def handover(four_ranks):
    return four_ranks[0]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tp1_logits_equal_hf(one_rank, architecture):
    result = one_rank[ARCHITECTURES.index(architecture)]
    valid = result["attention_mask"].bool()
    assert (result["logits"] - result["hf_logits"]).abs()[valid].max() < 1e-5
    hf_log_probs = torch.log_softmax(result["hf_logits"][:, -5:-1], -1)
    tokens = result["responses"].unsqueeze(-1)
    assert (result["log_probs"] - hf_log_probs.gather(-1, tokens).squeeze(-1)).abs().max() < 1e-5
    assert result["weights_equal"] and result["weights_missing"] == []


def test_tp2_logits_and_generation_weights_equal_hf(two_ranks):
    results = two_ranks[0]
    for result in results:
        valid = result["attention_mask"].bool()
        assert (result["logits"] - result["hf_logits"]).abs()[valid].max() < 1e-5
        assert result["weights_equal"] and result["weights_missing"] == []
        assert result["stats"].bytes_received > 0
        assert result["stats"].path == "gather"  # vocab 45 is padded to 48 for t=2: the planner cannot name it


def test_tp2_qwen3_logits_and_generation_weights_equal_hf(two_ranks):
    for result in two_ranks[4]:
        valid = result["attention_mask"].bool()
        assert (result["logits"] - result["hf_logits"]).abs()[valid].max() < 1e-5
        assert result["weights_equal"] and result["weights_missing"] == []
        assert any(".self_attn.q_norm." in name for name in result["hf_names"])


def _assert_matches_reference(results, reference, atol=2e-5):
    rows = len(reference["before"])
    for result in results:
        dp_rank, dp_size, _ = result["mesh"]
        share = slice(dp_rank * rows // dp_size, (dp_rank + 1) * rows // dp_size)
        assert torch.allclose(result["before"], reference["before"][share], atol=1e-5)
        assert torch.allclose(result["after"], reference["after"][share], atol=atol)
        assert result["version"] == reference["version"] == 2
    moved = (reference["after"] - reference["before"]).abs().max()
    assert moved > 1e-2  # the steps changed the policy, so equality above is not vacuous


def test_tp2_train_steps_equal_one_rank(one_rank, two_ranks):
    reference, results = one_rank[2], two_ranks[1]
    _assert_matches_reference(results, reference)
    for step in range(2):
        assert abs(results[0]["metrics"][step]["loss"] - reference["metrics"][step]["loss"]) < 1e-5
        assert abs(results[0]["metrics"][step]["grad_norm"] - reference["metrics"][step]["grad_norm"]) < 1e-4
    assert [r["mesh"] for r in results] == [(0, 1, True), (0, 1, False)]


def test_pp2_train_steps_equal_one_rank(one_rank, two_ranks):
    reference, results = one_rank[2], two_ranks[2]
    _assert_matches_reference(results, reference)
    assert [r["mesh"] for r in results] == [(0, 1, False), (0, 1, True)]
    assert results[0]["metrics"] == results[1]["metrics"]  # broadcast from the last stage


def test_tp2_dp2_train_steps_equal_one_rank(four_ranks, one_rank):
    reference, results = one_rank[2], four_ranks[1]
    _assert_matches_reference(results, reference)
    assert sorted(r["mesh"] for r in results) == [(0, 2, False), (0, 2, True), (1, 2, False), (1, 2, True)]


def test_train_step_without_entropy_bonus_reports_the_policy_entropy(one_rank):
    """``actor/entropy`` (detached, no bonus) = the mean over micro-batches of their masked mean token entropy
    under the weights before the step."""
    result = one_rank[3]
    from megatron_ranks import make_batch

    mask = make_batch(rows=8)["response_mask"].bool()
    entropy = result["entropy"]
    expected = sum(float(entropy[rows][mask[rows]].mean()) for rows in (slice(0, 2), slice(2, 4), slice(4, 6),
                                                                        slice(6, 8))) / 4
    assert abs(result["metrics"][0]["actor/entropy"] - expected) < 1e-5 and expected > 0


@pytest.mark.parametrize("case", range(len(HANDOVER)), ids=HANDOVER_IDS)
def test_tg1_receives_exactly_the_lower_bound(handover, case):
    for rank, result in enumerate(handover[case]):
        first, second = result["stats"]
        assert first.path == second.path == "reshard"
        assert result["lower_bound"] == result["full_minus_held"] > 0, rank
        assert first.bytes_received == second.bytes_received == result["lower_bound"], (rank, first)
        assert first.lower_bound_bytes == result["lower_bound"]
        assert result["plan_reused"] and result["buckets"] > 1
        assert first.peak_extra_bytes <= max(BUCKET_BYTES, first.max_bucket_cost), (rank, first)


@pytest.mark.parametrize("case", range(len(HANDOVER)), ids=HANDOVER_IDS)
def test_tg1_weights_equal_the_hf_model_bit_for_bit(handover, case):
    tied = HANDOVER[case]["model"]["tie_word_embeddings"]
    for result in handover[case]:
        missing = set(result["hf_names"]) - set(result["names"])
        assert missing == ({"lm_head.weight"} if tied else set())
        assert set(result["names"]) <= set(result["hf_names"])
        assert result["unequal"] == [] and result["second_unequal"] == []
        assert "must be one of ['hf', 'vllm']" in result["bad_target"]


@pytest.mark.parametrize("case", range(len(HANDOVER)), ids=HANDOVER_IDS)
def test_after_a_train_step_reshard_equals_the_gather_path(handover, case):
    for result in handover[case]:
        assert result["after_stats"].bytes_received == result["lower_bound"]
        assert result["after_changed"]  # the step moved the weights, so the equality below is not vacuous
        assert result["after_vs_gather_unequal"] == []
        assert result["gather_bytes"] >= result["lower_bound"]


@pytest.mark.parametrize("case", range(len(HANDOVER)), ids=HANDOVER_IDS)
def test_vllm_fused_target_at_tg_t_moves_the_lower_bound(handover, case):
    if handover[case][0]["vllm"] is None:
        pytest.skip("hybridflow-vllm (its layout) is not installed")
    for rank, result in enumerate(handover[case]):
        vllm = result["vllm"]
        assert vllm["names_equal"] and vllm["unequal"] == [] and vllm["fused"]
        assert vllm["stats"].bytes_received == vllm["lower_bound"], (rank, vllm["stats"])
    if HANDOVER[case]["pp"] == 1:  # megatron's TP shards already are vLLM's (same kv groups per rank): nothing moves
        assert all(result["vllm"]["lower_bound"] == 0 for result in handover[case])
    else:
        assert all(result["vllm"]["lower_bound"] > 0 for result in handover[case])


@pytest.mark.parametrize("case", range(len(PARK)), ids=PARK_IDS)
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


@pytest.mark.parametrize("case", range(len(PARK)), ids=PARK_IDS)
def test_tg2_holds_megatrons_shards_once(parked, case):
    for rank, result in enumerate(parked[case]):
        model, training, held = result["model_bytes"], result["training_bytes"], result["held_bytes"]
        two = result[2]
        stats = two["stats"]
        # megatron's shard is tg's: M/2, the replicated norms whole (their other half: a few hundred bytes)
        assert model // 2 < held == two["target_bytes"] < model // 2 + two["bucket"], (rank, result)
        assert two["names_equal"] and two["mismatched"] == [], (rank, two["mismatched"][:4])
        assert stats.bytes_received == stats.lower_bound_bytes == 0, stats  # t = tg: megatron's shards are tg's
        if PARK[case]["model"]["num_kv_heads"] == 2:  # every generation shard a view: nothing to park, no copy
            assert stats.aliased_bytes == held and stats.parked_bytes == 0, stats
            assert two["generation_bytes"] == training, (rank, two)
        else:  # q/k/v copied out: the buffer parks (the views became copies), the generation shards stay alone
            assert stats.aliased_bytes < held and stats.parked_bytes == training, stats
            assert two["parked_training_bytes"] == 0 and two["generation_bytes"] == held, (rank, two)
        assert two["generation_bytes"] <= model // 2 + two["bucket"]  # M/(tg·pg) + one bucket
        assert two["restored_equal"] and two["restored_bytes"] == training, (rank, two)
        assert two["forward_after_park_equal"] and two["after_forward_equal"], rank


@pytest.mark.parametrize("case", range(len(PARK)), ids=PARK_IDS)
def test_a_train_step_after_a_park_restores_first(parked, case):
    for result in parked[case]:
        assert result["stepped"] and result["stepped_bytes"] == result["training_bytes"]


def test_p2_t2_parks_on_both_stages_at_every_tg_and_trains_as_unparked(four_ranks):
    """p = 2, t = 2, tied embeddings: the last stage's param buffer (its output-layer copy of the embedding parked
    in the generation shard of the embedding) parks like the first stage's, at tg = 4 too (the cells other ranks'
    generation shards hold are fetched back by the reverse plan); resident bytes counted from storages."""
    _, _, parked, unparked = four_ranks
    assert [r["last_stage"] and r["tied_copy"] for r in parked] == [False, False, True, True]
    for rank, result in enumerate(parked):
        model, training = result["model_bytes"], result["training_bytes"]
        assert model // 4 <= training < model // 2, (rank, result)  # a quarter of the model (its DDP buffer)
        for tensor in (1, 2, 4):
            one = result[tensor]
            stats, budget = one["stats"], model // tensor + one["bucket"]  # M/(tg·pg) + one bucket
            assert stats.bytes_received == stats.lower_bound_bytes, (rank, tensor, stats)
            assert one["generation_bytes"] <= budget, (rank, tensor, one)
            assert one["restored_equal"], (rank, tensor)  # bit for bit after end_generation()
            if tensor == 2 and not result["last_stage"]:  # every first-stage shard a view: nothing to gain
                assert stats.parked_bytes == 0 and stats.aliased_bytes > 0, (rank, stats)
                continue
            # the buffer is gone, the output-layer copy with it: the generation shards alone are resident
            assert stats.parked_bytes == training and one["parked_training_bytes"] == 0, (rank, tensor, one)
            assert one["generation_bytes"] == one["target_bytes"], (rank, tensor, one)
            if tensor == 4:  # half of each training shard lies in other ranks' generation shards: fetched back
                assert one["fetch"].bytes_received == stats.fetch_bytes > 0, (rank, one["fetch"], stats)
                assert "call engine.end_generation() on every rank" in one["forward_error"]
            else:
                assert stats.fetch_bytes == 0 and one["fetch"] is None, (rank, tensor, stats)
    for rank, (a, b) in enumerate(zip(parked, unparked, strict=True)):
        assert 1 not in b  # the unparked run skipped the handovers
        assert all(torch.equal(x, y) for x, y in zip(a["before"], b["before"], strict=True)), rank
        assert any(not torch.equal(x, y) for x, y in zip(a["before"], a["after"], strict=True)), rank  # it moved
        assert all(torch.equal(x, y) for x, y in zip(a["after"], b["after"], strict=True)), rank
