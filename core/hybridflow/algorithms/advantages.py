"""Masked reductions, token-level rewards and the advantage estimators (GAE, GRPO, RLOO, REINFORCE++, ReMax,
on-policy distillation).

Pure torch on ``[B, R]`` response tensors with a ``response_mask`` (bool or 0/1 float): padded positions never
influence a result, even when they hold NaN, and every ``[B, R]`` output is 0 there. Which estimator an algorithm
uses, and whether its advantages are whitened afterwards, is left to the drivers. Stability: public.
"""

from __future__ import annotations

import torch

from hybridflow.errors import ConfigError, HybridflowError

__all__ = [
    "AlgorithmInputError",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "whiten",
    "build_token_level_rewards",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_remax_advantages",
    "combine_reward_and_cost_advantages",
    "compute_distillation_advantages",
]


class AlgorithmInputError(HybridflowError, ValueError):
    """A tensor handed to the RL math has the wrong shape or an invalid value."""


def _check_mask(name: str, tensor: torch.Tensor, response_mask: torch.Tensor) -> None:
    if tensor.shape != response_mask.shape:
        raise AlgorithmInputError(
            f"{name} has shape {tuple(tensor.shape)}, expected the response_mask shape {tuple(response_mask.shape)} "
            f"([batch, response_length]); pass per-token tensors aligned with the response tokens"
        )


def _check_scores(name: str, scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise AlgorithmInputError(
            f"{name} has shape {tuple(scores.shape)}, expected ({response_mask.shape[0]},): one score per row of the "
            f"response_mask {tuple(response_mask.shape)}"
        )


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_padding(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with padded positions set to 0 (``where``, not a product, so NaN padding cannot leak)."""
    return torch.where(_valid(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over positions where ``mask`` is set (over everything when ``dim`` is None)."""
    masked = _zero_padding(values, mask) * (mask if mask.is_floating_point() else 1)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over masked positions; 0 where the mask selects nothing."""
    weights = mask.to(values.dtype)
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    total = masked_sum(values, mask, dim)
    safe_count = torch.where(count > 0, count, torch.ones_like(count))
    return torch.where(count > 0, total / safe_count, torch.zeros_like(total))


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all masked positions (Bessel-corrected when ``unbiased`` and ≥ 2 positions)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    count = mask.to(values.dtype).sum()
    if unbiased and count > 1:
        variance = variance * count / (count - 1)
    return variance


def whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Scale masked ``values`` to unit variance (and zero mean when ``shift_mean``); padding becomes 0."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_padding(whitened, mask)


def _last_valid_index(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each row's last masked token, and whether the row has one."""
    valid = _valid(response_mask)
    length = valid.shape[1]
    positions = torch.arange(length, device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    return last.clamp(min=0), last >= 0


def build_token_level_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Rewards ``[B, R]``: ``-kl_coef · kl`` on every response token plus the sequence score on the last one.

    A row whose mask selects no token gets no reward at all (there is no token to carry its score).
    """
    _check_scores("scores", scores, response_mask)
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    rewards = torch.zeros(response_mask.shape, dtype=dtype, device=scores.device)
    if kl is not None:
        _check_mask("kl", kl, response_mask)
        rewards = rewards - kl_coef * _zero_padding(kl.to(dtype), response_mask)
    last, has_token = _last_valid_index(response_mask)
    rows = torch.arange(len(scores), device=scores.device)
    rewards[rows, last] += torch.where(has_token, scores.to(dtype), torch.zeros((), dtype=dtype, device=scores.device))
    return rewards


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); returns ``(advantages, returns)``, not whitened.

    The recursion runs over masked tokens only: a masked-out token (padding, or a tool-output hole inside a
    multi-turn response) is skipped, so ``V(next)`` is the value of the next *masked* token and 0 after the last.
    """
    _check_mask("token_rewards", token_rewards, response_mask)
    _check_mask("values", values, response_mask)
    valid = _valid(response_mask)
    rewards = _zero_padding(token_rewards, valid)
    values = _zero_padding(values, valid)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(valid[:, t], candidate, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = running
    advantages = _zero_padding(advantages, valid)
    return advantages, _zero_padding(advantages + values, valid)


def _group_index(groups: int | torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """Dense group index per row: from ``n`` (consecutive rows of ``n``) or from arbitrary group ids ``[B]``."""
    if isinstance(groups, torch.Tensor):
        if groups.shape != (batch_size,):
            raise AlgorithmInputError(
                f"group ids have shape {tuple(groups.shape)}, expected ({batch_size},): one id per row"
            )
        inverse: torch.Tensor = torch.unique(groups.to(device), return_inverse=True)[1]
        return inverse
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or batch_size % groups:
        raise ConfigError(
            f"samples per prompt n={groups!r} must be a positive int dividing the batch size {batch_size}; rows "
            f"i·n … i·n+n−1 form one group (Batch.repeat_interleave layout), or pass a tensor of group ids"
        )
    return torch.arange(batch_size, device=device) // groups


def _group_sums(values: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    size = int(index.max()) + 1 if len(index) else 0
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, torch.ones_like(values))
    return sums, counts


def _float_scores(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.is_floating_point() else scores.to(torch.float32)


def compute_grpo_advantages(
    scores: torch.Tensor,
    groups: int | torch.Tensor,
    response_mask: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): each score minus its group mean, over the group std; broadcast to ``[B, R]``.

    ``groups`` is ``n`` (consecutive rows of ``n`` samples share a prompt) or a tensor of group ids ``[B]``. The std
    is Bessel-corrected; ``normalize_std=False`` gives Dr. GRPO. A one-sample group has advantage 0 (no baseline).
    """
    _check_scores("scores", scores, response_mask)
    scores = _float_scores(scores)
    index = _group_index(groups, len(scores), scores.device)
    sums, counts = _group_sums(scores, index)
    mean = (sums / counts)[index]
    squares, _ = _group_sums((scores - mean) ** 2, index)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))[index]
    advantages = scores - mean
    if normalize_std:
        advantages = advantages / (std + eps)
    advantages = torch.where(counts[index] > 1, advantages, torch.zeros_like(advantages))
    return _zero_padding(advantages[:, None].expand(response_mask.shape), response_mask)


def compute_rloo_advantages(
    scores: torch.Tensor, groups: int | torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each score minus the mean of the *other* samples of its group, to ``[B, R]``.

    A one-sample group has advantage 0 (there is no other sample to form a baseline).
    """
    _check_scores("scores", scores, response_mask)
    scores = _float_scores(scores)
    index = _group_index(groups, len(scores), scores.device)
    sums, counts = _group_sums(scores, index)
    others = (counts[index] - 1).clamp(min=1)
    baseline = (sums[index] - scores) / others
    advantages = torch.where(counts[index] > 1, scores - baseline, torch.zeros_like(scores))
    return _zero_padding(advantages[:, None].expand(response_mask.shape), response_mask)


def compute_reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted returns-to-go over masked tokens, whitened over the whole batch."""
    _check_mask("token_rewards", token_rewards, response_mask)
    valid = _valid(response_mask)
    rewards = _zero_padding(token_rewards, valid)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return whiten(returns, valid)


def compute_remax_advantages(
    scores: torch.Tensor, baseline_scores: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """ReMax (Li et al. 2024): sampled-response score minus the greedy response's score, broadcast to ``[B, R]``."""
    _check_scores("scores", scores, response_mask)
    _check_scores("baseline_scores", baseline_scores, response_mask)
    advantages = _float_scores(scores) - _float_scores(baseline_scores)
    return _zero_padding(advantages[:, None].expand(response_mask.shape), response_mask)


def combine_reward_and_cost_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, multiplier: float
) -> torch.Tensor:
    """Safe-RLHF (Dai et al. 2024): ``(A_reward − λ·A_cost) / (1 + λ)``, the Lagrangian's advantage kept at scale."""
    if multiplier < 0:
        raise AlgorithmInputError(f"the Lagrange multiplier must be ≥ 0, got {multiplier}; use LagrangeMultiplier")
    if reward_advantages.shape != cost_advantages.shape:
        raise AlgorithmInputError(
            f"reward advantages {tuple(reward_advantages.shape)} and cost advantages "
            f"{tuple(cost_advantages.shape)} must have the same shape"
        )
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)


def compute_distillation_advantages(
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float = 1.0,
    task_advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD at λ = 1 with the reverse KL; Thinking Machines 2025): each
    sampled token's advantage is ``coef · (log π_teacher(y_t) − log π_student(y_t))``, the negative per-token
    reverse-KL estimate (discount 0: no return over later tokens), plus ``task_advantages`` ``[B, R]`` (e.g. GRPO's
    from a task reward) when given. ``student_log_probs`` are the sampling policy's (π_old); the policy gradient of
    these advantages lowers KL(π_student ‖ π_teacher) on the student's own samples.
    """
    _check_mask("teacher_log_probs", teacher_log_probs, response_mask)
    _check_mask("student_log_probs", student_log_probs, response_mask)
    valid = _valid(response_mask)
    teacher, student = _zero_padding(teacher_log_probs.float(), valid), _zero_padding(student_log_probs.float(), valid)
    advantages = coef * (teacher - student)
    if task_advantages is not None:
        _check_mask("task_advantages", task_advantages, response_mask)
        advantages = advantages + _zero_padding(task_advantages.float(), valid)
    return _zero_padding(advantages, valid)
