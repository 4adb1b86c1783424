"""Megatron train → generate handover through the core reshard planner: (p, t, d) = (1, 2, 2) and (2, 2, 1) → tg = 1
receive exactly the per-rank lower bound and yield the HF weights bit for bit (one 4-process gloo run for both)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron

BUCKET_BYTES = 64 << 10  # several buckets for the ~330 KB test model, so the peak bound below says something
CASES = [  # vocab 64: a multiple of 8·t, so megatron pads nothing and the planner path runs
    {"pp": 1, "tp": 2, "model": {"architecture": "llama", "num_heads": 4, "num_kv_heads": 2,
                                 "tie_word_embeddings": False}},
    {"pp": 2, "tp": 2, "model": {"architecture": "qwen2", "num_heads": 4, "num_kv_heads": 2,
                                 "tie_word_embeddings": True}},
]
IDS = ["p1t2d2_llama", "p2t2d1_qwen2_tied"]


@pytest.fixture(scope="module")
def handover(module_ranks):
    args = {"cases": CASES, "config": {"vocab_size": 64}, "extra": {"handover_bucket_bytes": BUCKET_BYTES},
            "micro_batch_size": 1}
    results = module_ranks("handover", 4, args, timeout_s=420)
    return [[result["cases"][index] for result in results] for index in range(len(CASES))]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_tg1_receives_exactly_the_lower_bound(handover, case):
    for rank, result in enumerate(handover[case]):
        first, second = result["stats"]
        assert first.path == second.path == "reshard"
        assert result["lower_bound"] == result["full_minus_held"] > 0, rank
        assert first.bytes_received == second.bytes_received == result["lower_bound"], (rank, first)
        assert first.lower_bound_bytes == result["lower_bound"]
        assert result["plan_reused"] and result["buckets"] > 1
        assert first.peak_extra_bytes <= max(BUCKET_BYTES, first.max_bucket_cost), (rank, first)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_tg1_weights_equal_the_hf_model_bit_for_bit(handover, case):
    tied = CASES[case]["model"]["tie_word_embeddings"]
    for result in handover[case]:
        missing = set(result["hf_names"]) - set(result["names"])
        assert missing == ({"lm_head.weight"} if tied else set())
        assert set(result["names"]) <= set(result["hf_names"])
        assert result["unequal"] == [] and result["second_unequal"] == []
        assert "must be one of ['hf', 'vllm']" in result["bad_target"]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_after_a_train_step_reshard_equals_the_gather_path(handover, case):
    for result in handover[case]:
        assert result["after_stats"].bytes_received == result["lower_bound"]
        assert result["after_changed"]  # the step moved the weights, so the equality below is not vacuous
        assert result["after_vs_gather_unequal"] == []
        assert result["gather_bytes"] >= result["lower_bound"]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_vllm_fused_target_at_tg_t_moves_the_lower_bound(handover, case):
    if handover[case][0]["vllm"] is None:
        pytest.skip("hybridflow-vllm (its layout) is not installed")
    for rank, result in enumerate(handover[case]):
        vllm = result["vllm"]
        assert vllm["names_equal"] and vllm["unequal"] == [] and vllm["fused"]
        assert vllm["stats"].bytes_received == vllm["lower_bound"], (rank, vllm["stats"])
    if CASES[case]["pp"] == 1:  # megatron's TP shards already are vLLM's (same kv groups per rank): nothing moves
        assert all(result["vllm"]["lower_bound"] == 0 for result in handover[case])
    else:
        assert all(result["vllm"]["lower_bound"] > 0 for result in handover[case])
