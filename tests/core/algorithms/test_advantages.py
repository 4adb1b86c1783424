"""Advantage estimators and masked reductions against hand-rolled references, with padding and holes in the mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms.advantages import (
    AlgorithmInputError,
    build_token_level_rewards,
    combine_reward_and_cost_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    masked_mean,
    masked_sum,
    masked_var,
    whiten,
)
from hybridflow.errors import ConfigError

torch.set_num_threads(1)
PROPERTY = settings(max_examples=40, deadline=None)


def random_case(seed: int, batch: int, length: int, *, holes: bool = True) -> tuple[torch.Tensor, ...]:
    """Rewards, values and a response mask; padding (and holes) hold NaN so any leak shows."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(batch, length, generator=generator) > 0.25
    rewards[~mask] = float("nan")
    values[~mask] = float("nan")
    return rewards, values, mask


def reference_gae(rewards, values, mask, gamma, lam):
    """Per-row python loop over the valid tokens only (V after the last valid token is 0)."""
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for row in range(mask.shape[0]):
        steps = [t for t in range(mask.shape[1]) if mask[row, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[row, t]) + gamma * next_value - float(values[row, t])
            running = delta + gamma * lam * running
            advantages[row, t] = running
            returns[row, t] = running + float(values[row, t])
            next_value = float(values[row, t])
    return advantages, returns


def reference_discounted_returns(rewards, mask, gamma):
    returns = torch.zeros_like(rewards)
    for row in range(mask.shape[0]):
        running = 0.0
        for t in reversed([t for t in range(mask.shape[1]) if mask[row, t]]):
            running = float(rewards[row, t]) + gamma * running
            returns[row, t] = running
    return returns


@PROPERTY
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 7), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_hand_rolled_reference(seed, batch, length, gamma, lam):
    rewards, values, mask = random_case(seed, batch, length)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    expected_advantages, expected_returns = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)


@PROPERTY
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 7), st.floats(0.0, 1.0))
def test_gae_with_lambda_one_and_zero_values_is_discounted_return(seed, batch, length, gamma):
    rewards, _, mask = random_case(seed, batch, length)
    advantages, returns = compute_gae(rewards, torch.zeros_like(rewards), mask.float(), gamma, 1.0)
    expected = reference_discounted_returns(rewards, mask, gamma)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_gae_ignores_padding_and_zeroes_it():
    rewards, values, mask = random_case(3, 4, 6, holes=False)
    first, first_returns = compute_gae(rewards, values, mask, 0.99, 0.95)
    rewards[~mask], values[~mask] = 1e6, -1e6
    second, second_returns = compute_gae(rewards, values, mask, 0.99, 0.95)
    assert torch.equal(first, second) and torch.equal(first_returns, second_returns)
    assert torch.all(first[~mask] == 0) and torch.all(first_returns[~mask] == 0)
    assert torch.isfinite(first).all()


def test_gae_single_token_is_one_step_td_error():
    rewards = torch.tensor([[2.0, 0.0]])
    values = torch.tensor([[0.5, 9.0]])
    advantages, returns = compute_gae(rewards, values, torch.tensor([[1, 0]]), 0.9, 0.8)
    assert advantages[0, 0].item() == pytest.approx(2.0 - 0.5) and returns[0, 0].item() == pytest.approx(2.0)


def test_gae_rejects_misaligned_shapes():
    with pytest.raises(AlgorithmInputError, match="response_mask shape"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


@PROPERTY
@given(st.integers(0, 10_000), st.integers(2, 5), st.integers(1, 4))
def test_grpo_is_zero_mean_unit_std_per_group(seed, n, prompts):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(n * prompts, generator=generator, dtype=torch.float64)
    mask = torch.ones(n * prompts, 3)
    advantages = compute_grpo_advantages(scores, n, mask)[:, 0].view(prompts, n)
    torch.testing.assert_close(advantages.mean(dim=1), torch.zeros(prompts, dtype=torch.float64))
    # unit std up to the eps the std is offset by: std / (std + eps)
    group_std = scores.view(prompts, n).std(dim=1)
    torch.testing.assert_close(advantages.std(dim=1), group_std / (group_std + 1e-6), atol=1e-9, rtol=1e-9)
    assert bool((advantages.std(dim=1) - 1).abs().lt(1e-6 / group_std.clamp(min=1e-12) + 1e-9).all())


def test_grpo_constant_group_and_singleton_get_zero():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 5.0])
    group_ids = torch.tensor([7, 7, 7, 3, 3, 9])
    advantages = compute_grpo_advantages(scores, group_ids, torch.ones(6, 2))
    assert torch.all(advantages[:3] == 0) and torch.all(advantages[5] == 0)
    assert advantages[3, 0] < 0 < advantages[4, 0]
    torch.testing.assert_close(advantages[3:5, 0], torch.tensor([-0.5, 0.5]) / math.sqrt(0.5), rtol=1e-5, atol=1e-5)


def test_grpo_group_ids_equal_consecutive_layout_and_dr_grpo_skips_std():
    scores = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 8.0])
    mask = torch.tensor([[1, 1, 0]] * 6)
    by_n = compute_grpo_advantages(scores, 3, mask)
    by_ids = compute_grpo_advantages(scores, torch.tensor([0, 0, 0, 1, 1, 1]), mask)
    assert torch.equal(by_n, by_ids)
    assert torch.all(by_n[:, 2] == 0)
    unscaled = compute_grpo_advantages(scores, 3, mask, normalize_std=False)
    torch.testing.assert_close(unscaled[:, 0], torch.tensor([-4 / 3, -1 / 3, 5 / 3, -2.0, -2.0, 4.0]))


def test_grpo_rejects_n_not_dividing_batch():
    with pytest.raises(ConfigError, match="dividing the batch size 5"):
        compute_grpo_advantages(torch.zeros(5), 2, torch.ones(5, 1))


@PROPERTY
@given(st.integers(0, 10_000), st.integers(2, 5), st.integers(1, 3), st.floats(-5.0, 5.0))
def test_rloo_baseline_excludes_self(seed, n, prompts, shift):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(n * prompts, generator=generator, dtype=torch.float64)
    mask = torch.ones(n * prompts, 2)
    advantages = compute_rloo_advantages(scores, n, mask)[:, 0]
    for row in range(n * prompts):
        group = range(row // n * n, row // n * n + n)
        others = [float(scores[j]) for j in group if j != row]
        assert float(advantages[row]) == pytest.approx(float(scores[row]) - sum(others) / len(others))
    moved = scores.clone()
    moved[0] += shift  # own score moves its advantage one for one: the baseline does not contain it
    assert float(compute_rloo_advantages(moved, n, mask)[0, 0] - advantages[0]) == pytest.approx(shift)


def test_remax_is_reward_minus_greedy_baseline_on_valid_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages = compute_remax_advantages(torch.tensor([1.0, 0.25]), torch.tensor([0.5, 1.0]), mask)
    assert torch.equal(advantages, torch.tensor([[0.5, 0.5, 0.0], [-0.75, 0.0, 0.0]]))


@PROPERTY
@given(st.integers(0, 10_000), st.integers(2, 4), st.integers(2, 6), st.floats(0.5, 1.0))
def test_reinforce_plus_plus_whitens_discounted_returns(seed, batch, length, gamma):
    rewards, _, mask = random_case(seed, batch, length, holes=False)
    mask[:2, 0] = True  # at least two valid tokens; padding elsewhere still holds NaN
    rewards[:2, 0] = torch.tensor([0.3, -0.7], dtype=rewards.dtype)
    advantages = compute_reinforce_plus_plus_advantages(rewards, mask, gamma)
    returns = reference_discounted_returns(rewards, mask, gamma)[mask]
    expected = (returns - returns.mean()) / torch.sqrt(returns.var() + 1e-8)
    torch.testing.assert_close(advantages[mask], expected)
    assert torch.all(advantages[~mask] == 0)
    assert abs(float(advantages[mask].mean())) < 1e-9


@PROPERTY
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 6))
def test_masked_reductions_match_selected_elements(seed, batch, length):
    values, _, mask = random_case(seed, batch, length)
    selected = values[mask]
    torch.testing.assert_close(masked_sum(values, mask), selected.sum())
    if selected.numel() == 0:
        assert float(masked_mean(values, mask)) == 0.0
        return
    torch.testing.assert_close(masked_mean(values, mask), selected.mean())
    if selected.numel() > 1:
        torch.testing.assert_close(masked_var(values, mask), selected.var())
        torch.testing.assert_close(masked_var(values, mask, unbiased=False), selected.var(unbiased=False))
    row_means = masked_mean(values, mask, dim=1)
    for row in range(batch):
        expected = values[row][mask[row]].mean() if mask[row].any() else torch.tensor(0.0, dtype=values.dtype)
        torch.testing.assert_close(row_means[row], expected)


def test_whiten_without_mean_shift_keeps_the_mean():
    values = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [5.0, 9.0, float("nan"), float("nan")]])
    mask = torch.isfinite(values)
    shifted = whiten(values, mask)
    kept = whiten(values, mask, shift_mean=False)
    assert float(masked_mean(shifted, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(masked_var(shifted, mask)) == pytest.approx(1.0, rel=1e-5)
    assert float(masked_mean(kept, mask)) == pytest.approx(4.0, rel=1e-6)
    assert torch.all(kept[~mask] == 0)


def test_token_level_rewards_put_score_on_last_valid_token_minus_kl():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 50.0], [1.0, 50.0, 2.0, float("nan")], [9.0, 9.0, 9.0, 9.0]])
    rewards = build_token_level_rewards(torch.tensor([1.0, -2.0, 4.0]), mask, kl, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, 1.0 - 0.15, 0.0], [-0.5, 0.0, -2.0 - 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    only_score = build_token_level_rewards(torch.tensor([3.0]), torch.tensor([[1, 1]]))
    assert torch.equal(only_score, torch.tensor([[0.0, 3.0]]))
    with pytest.raises(AlgorithmInputError, match="one score per row"):
        build_token_level_rewards(torch.zeros(2), mask)


def test_safe_rlhf_combination_weights_cost_by_multiplier():
    reward, cost = torch.tensor([1.0, 2.0]), torch.tensor([4.0, -1.0])
    assert torch.equal(combine_reward_and_cost_advantages(reward, cost, 0.0), reward)
    torch.testing.assert_close(combine_reward_and_cost_advantages(reward, cost, 1.0), torch.tensor([-1.5, 1.5]))
    with pytest.raises(AlgorithmInputError, match="≥ 0"):
        combine_reward_and_cost_advantages(reward, cost, -0.1)
