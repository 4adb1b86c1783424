"""Off-policy correction of the actor loss (``algorithm.rollout_correction``): per-token weights π_old / π_rollout,
truncated (tis) or masked (mis), and the rollout-vs-train probability gap logged every step."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.losses import (
    PolicyLossConfig,
    compute_rollout_correction_weights,
    make_actor_loss_fn,
)
from hybridflow.algorithms.runtime import compute_rollout_probs_diff
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError

RATIOS = [0.25, 0.8, 1.0, 1.5, 3.0]


def _log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.full((1, len(RATIOS)), -1.0)
    return rollout + torch.tensor([RATIOS]).log(), rollout  # (old, rollout): old − rollout = log ρ


def test_tis_truncates_the_weights_at_the_threshold() -> None:
    old, rollout = _log_probs()
    weights, metrics = compute_rollout_correction_weights(old, rollout, torch.ones_like(old), mode="tis",
                                                          threshold=2.0)
    assert weights[0].tolist() == pytest.approx([0.25, 0.8, 1.0, 1.5, 2.0])
    assert metrics["rollout_is_truncated_fraction"] == pytest.approx(1 / 5)


def test_mis_masks_the_tokens_outside_the_trust_band() -> None:
    old, rollout = _log_probs()
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding: weight 0 and not counted
    weights, metrics = compute_rollout_correction_weights(old, rollout, mask, mode="mis", threshold=2.0)
    assert weights[0].tolist() == pytest.approx([0.0, 0.8, 1.0, 1.5, 0.0])
    assert metrics["rollout_is_masked_fraction"] == pytest.approx(1 / 4)
    with pytest.raises(ConfigError, match="rollout_correction must be one of none, tis, mis"):
        compute_rollout_correction_weights(old, rollout, mask, mode="clip", threshold=2.0)
    with pytest.raises(ConfigError, match="> 1"):
        PolicyLossConfig(rollout_correction="tis", rollout_correction_threshold=1.0)


def test_the_actor_loss_weights_each_tokens_gradient_by_the_correction() -> None:
    old, rollout = _log_probs()
    advantages = torch.ones_like(old)
    batch = Batch({"old_log_probs": old, "rollout_log_probs": rollout, "advantages": advantages,
                   "response_mask": torch.ones_like(old)})
    grads = {}
    for mode in ("none", "tis", "mis"):
        log_probs = old.clone().requires_grad_(True)  # ratio 1: inside the clip range, gradient −A/T per token
        loss, metrics = make_actor_loss_fn(PolicyLossConfig(rollout_correction=mode))({"log_probs": log_probs}, batch)
        loss.backward()
        assert log_probs.grad is not None
        grads[mode] = (-log_probs.grad[0] * len(RATIOS)).tolist()
        assert ("actor/rollout_is_weight_mean" in metrics) == (mode != "none")
    assert grads["none"] == pytest.approx([1.0] * 5)
    assert grads["tis"] == pytest.approx([0.25, 0.8, 1.0, 1.5, 2.0])
    assert grads["mis"] == pytest.approx([0.0, 0.8, 1.0, 1.5, 0.0])
    with pytest.raises(Exception, match="rollout_log_probs"):
        make_actor_loss_fn(PolicyLossConfig(rollout_correction="tis"))(
            {"log_probs": old}, Batch({"old_log_probs": old, "advantages": advantages,
                                       "response_mask": torch.ones_like(old)}))


def test_rollout_probs_diff_is_the_token_probability_gap_over_valid_tokens() -> None:
    rollout = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    old = torch.tensor([[math.log(0.4), math.log(0.2), math.log(0.1)]])
    metrics = compute_rollout_probs_diff(rollout, old, torch.tensor([[1, 1, 0]]))
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.05)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.1)
