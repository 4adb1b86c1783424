"""The megatron engine on CPU (gloo): HF-equal logits, TP/PP/DP train steps equal to one rank, roles and errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron

GQA = {"num_heads": 4, "num_kv_heads": 2}  # head 16, 2 query groups: tensor parallel 2 splits the groups


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_tp1_logits_equal_hf(ranks, architecture):
    model = {"architecture": architecture, **GQA, "tie_word_embeddings": architecture == "qwen2"}
    (result,) = ranks("logits", 1, {"model": model})
    valid = result["attention_mask"].bool()
    assert (result["logits"] - result["hf_logits"]).abs()[valid].max() < 1e-5
    hf_log_probs = torch.log_softmax(result["hf_logits"][:, -5:-1], -1)
    tokens = result["responses"].unsqueeze(-1)
    assert (result["log_probs"] - hf_log_probs.gather(-1, tokens).squeeze(-1)).abs().max() < 1e-5
    assert result["weights_equal"] and result["weights_missing"] == []


def test_tp2_logits_and_generation_weights_equal_hf(ranks):
    results = ranks("logits", 2, {"model": {"architecture": "qwen2", **GQA}, "tp": 2})
    for result in results:
        valid = result["attention_mask"].bool()
        assert (result["logits"] - result["hf_logits"]).abs()[valid].max() < 1e-5
        assert result["weights_equal"] and result["weights_missing"] == []
        assert result["stats"].bytes_received > 0
        assert result["stats"].path == "gather"  # vocab 45 is padded to 48 for t=2: the planner cannot name it


def _train(module_ranks, world, **args):
    base = {"model": {"architecture": "qwen2", **GQA}, "steps": 2, "micro_batch_size": 2}
    return module_ranks("train", world, {**base, **args})


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


def test_tp2_train_steps_equal_one_rank(module_ranks):
    (reference,) = _train(module_ranks, 1)
    results = _train(module_ranks, 2, tp=2)
    _assert_matches_reference(results, reference)
    for step in range(2):
        assert abs(results[0]["metrics"][step]["loss"] - reference["metrics"][step]["loss"]) < 1e-5
        assert abs(results[0]["metrics"][step]["grad_norm"] - reference["metrics"][step]["grad_norm"]) < 1e-4
    assert [r["mesh"] for r in results] == [(0, 1, True), (0, 1, False)]


def test_pp2_train_steps_equal_one_rank(module_ranks):
    (reference,) = _train(module_ranks, 1)
    results = _train(module_ranks, 2, pp=2)
    _assert_matches_reference(results, reference)
    assert [r["mesh"] for r in results] == [(0, 1, False), (0, 1, True)]
    assert results[0]["metrics"] == results[1]["metrics"]  # broadcast from the last stage


def test_tp2_dp2_train_steps_equal_one_rank(module_ranks):
    (reference,) = _train(module_ranks, 1)
    results = _train(module_ranks, 4, tp=2)
    _assert_matches_reference(results, reference)
    assert sorted(r["mesh"] for r in results) == [(0, 2, False), (0, 2, True), (1, 2, False), (1, 2, True)]


def test_train_step_without_entropy_bonus_reports_the_policy_entropy(module_ranks):
    """``actor/entropy`` (detached, no bonus) = the mean over micro-batches of their masked mean token entropy
    under the weights before the step."""
    (result,) = _train(module_ranks, 1, entropy_coef=0.0, steps=1)
    from megatron_ranks import make_batch

    mask = make_batch(rows=8)["response_mask"].bool()
    entropy = result["entropy"]
    expected = sum(float(entropy[rows][mask[rows]].mean()) for rows in (slice(0, 2), slice(2, 4), slice(4, 6),
                                                                        slice(6, 8))) / 4
    assert abs(result["metrics"][0]["actor/entropy"] - expected) < 1e-5 and expected > 0
