"""The per-step collapse metrics: response lengths and clip ratio, zero-advantage shares, the policy's entropy."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.advantages import compute_grpo_advantages
from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn
from hybridflow.algorithms.runtime import Runtime, compute_response_length_metrics, compute_zero_advantage_metrics
from hybridflow.batch import Batch


def test_response_length_max_and_clip_ratio_count_responses_at_the_limit() -> None:
    lengths = [8, 3, 8, 5, 1, 8]  # 3 of 6 hit max_new_tokens=8
    mask = torch.zeros(6, 10)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    metrics = compute_response_length_metrics(mask, max_new_tokens=8)
    assert metrics["response_length/clip_ratio"] == pytest.approx(3 / 6)
    assert metrics["response_length/max"] == 8 and metrics["response_length/min"] == 1
    assert metrics["response_length/mean"] == pytest.approx(sum(lengths) / 6)
    assert compute_response_length_metrics(mask, max_new_tokens=9)["response_length/clip_ratio"] == 0.0


def test_zero_advantage_group_ratio_on_grpo_groups() -> None:
    # 4 prompts × 3 samples: prompt 0 all right, prompt 2 all wrong -> 2 of 4 groups carry no gradient
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.5])
    mask = torch.ones(12, 4)
    mask[::2, 3] = 0
    advantages = compute_grpo_advantages(scores, 3, mask)
    uids = [f"p{i // 3}" for i in range(12)]
    metrics = compute_zero_advantage_metrics(advantages, mask, uids)
    assert metrics["critic/zero_adv_group_ratio"] == pytest.approx(2 / 4)
    assert metrics["critic/advantages/zero_adv_ratio"] == pytest.approx(6 / 12)
    collapsed = compute_zero_advantage_metrics(torch.zeros(12, 4), mask, uids)
    assert collapsed["critic/zero_adv_group_ratio"] == 1.0


def test_runtime_summary_reports_the_collapse_metrics() -> None:
    class Rollout:
        max_new_tokens = 4

    class Config:
        rollout = Rollout()

    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = Batch({"scores": torch.tensor([1.0, 1.0, 0.0, 1.0]), "response_mask": mask, "attention_mask": mask,
                   "advantages": torch.tensor([[0.0] * 4, [0.0] * 4, [-1.0] * 4, [1.0] * 4])},
                  {"uid": ["a", "a", "b", "b"]})
    summary = Runtime(config=Config(), tokenizer=None).summarize(batch)
    assert summary["response_length/clip_ratio"] == 0.5 and summary["response_length/max"] == 4
    assert summary["critic/zero_adv_group_ratio"] == 0.5


def test_actor_loss_logs_the_entropy_of_a_known_distribution_without_changing_the_loss() -> None:
    vocab = 8
    log_uniform = torch.full((2, 3, vocab), -math.log(vocab))  # entropy log 8 on every token
    entropy = -(log_uniform.exp() * log_uniform).sum(-1)
    log_probs = torch.full((2, 3), -1.0, requires_grad=True)
    micro = Batch({"old_log_probs": torch.full((2, 3), -1.2), "advantages": torch.ones(2, 3),
                   "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    loss_fn = make_actor_loss_fn(PolicyLossConfig())
    plain, _ = loss_fn({"log_probs": log_probs}, micro)
    loss, metrics = loss_fn({"log_probs": log_probs, "entropy": entropy}, micro)
    assert metrics["actor/entropy"] == pytest.approx(math.log(vocab))
    assert float(loss.detach()) == float(plain.detach())  # a detached entropy is a metric, not a bonus
    with_bonus, _ = make_actor_loss_fn(PolicyLossConfig(entropy_coef=0.1))({"log_probs": log_probs,
                                                                              "entropy": entropy}, micro)
    assert float(with_bonus.detach()) == pytest.approx(float(plain.detach()) - 0.1 * math.log(vocab))
