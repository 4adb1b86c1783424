"""Off-policy correction of the actor loss (``algorithm.rollout_correction``): weights π_old / π_rollout per token or
per sequence (``rollout_correction_level``: product or geometric mean of the row's token ratios), truncated (tis) or
masked (mis), and the rollout-vs-train probability gap logged every step."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.grpo import GRPO
from hybridflow.algorithms.losses import (
    ActorLoss,
    PolicyLossConfig,
    compute_rollout_correction_weights,
    make_actor_loss_fn,
)
from hybridflow.algorithms.runtime import compute_rollout_probs_diff
from hybridflow.batch import Batch
from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.trainer.build import build_tokenizer, plan_roles

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


#: per-token ratios ρ_t of three rows; 0.0 marks padding (its log-probs are garbage: must not count)
ROW_RATIOS = [[1.5, 1.2, 0.0, 0.0], [2.0, 1.5, 1.25, 0.0], [0.5, 0.5, 0.5, 0.6]]
PADDING_GARBAGE = 7.0  # old − rollout log-prob at padded positions: ρ = e^7 if padding leaked into a product


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[ratio > 0 for ratio in row] for row in ROW_RATIOS])
    log_ratio = torch.tensor([[math.log(r) if r > 0 else PADDING_GARBAGE for r in row] for row in ROW_RATIOS],
                             dtype=torch.float64)
    rollout = torch.full_like(log_ratio, -2.0)
    return rollout + log_ratio, rollout, mask  # (old, rollout, response_mask)


def _expected_row_ratios(level: str) -> list[float]:
    """By hand, over each row's valid tokens: Π ρ_t (sequence) or (Π ρ_t)^(1/n) (geometric)."""
    ratios = []
    for row in ROW_RATIOS:
        valid = [r for r in row if r > 0]
        product = math.prod(valid)
        ratios.append(product if level == "sequence" else product ** (1 / len(valid)))
    return ratios  # sequence: 1.8, 3.75, 0.075; geometric: √1.8, 3.75^(1/3), 0.075^(1/4)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_sequence_levels_weigh_every_token_of_a_row_by_the_rows_ratio(level: str, mode: str) -> None:
    old, rollout, mask = _rows()
    weights, metrics = compute_rollout_correction_weights(old, rollout, mask, mode=mode, threshold=2.0, level=level)
    row_ratios = _expected_row_ratios(level)
    if mode == "tis":
        row_weights = [min(ratio, 2.0) for ratio in row_ratios]
        cut = [ratio > 2.0 for ratio in row_ratios]
    else:
        cut = [not 0.5 <= ratio <= 2.0 for ratio in row_ratios]
        row_weights = [0.0 if out else ratio for ratio, out in zip(row_ratios, cut, strict=True)]
    expected = [[w if r > 0 else 0.0 for r in row] for w, row in zip(row_weights, ROW_RATIOS, strict=True)]
    assert weights.flatten().tolist() == pytest.approx([w for row in expected for w in row], rel=1e-12)
    fraction = "rollout_is_truncated_fraction" if mode == "tis" else "rollout_is_masked_fraction"
    assert metrics[fraction] == pytest.approx(sum(cut) / 3)  # per row, not per token
    assert metrics["rollout_is_weight_mean"] == pytest.approx(sum(row_weights) / 3)
    if level == "sequence":  # 1.8 kept whole, 3.75 cut (tis: to 2, mis: out), 0.075 below 1/2 (mis: out)
        assert cut == ([False, True, False] if mode == "tis" else [False, True, True])
    else:  # √1.8 = 1.34, 3.75^(1/3) = 1.55, 0.075^(1/4) = 0.52: all kept
        assert cut == [False, False, False]


def test_sequence_level_bounds_the_rows_log_ratio_and_ignores_rows_without_tokens() -> None:
    old = torch.tensor([[15.0, 15.0, 0.0], [0.0, 0.0, 0.0]])  # row 0: log ρ = 30 (> 20); row 1: a padding row
    rollout = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    weights, metrics = compute_rollout_correction_weights(old, rollout, mask, mode="tis", threshold=1e12,
                                                          level="sequence")
    assert weights.flatten().tolist() == pytest.approx([math.exp(20.0)] * 3 + [0.0] * 3)
    assert metrics["rollout_is_truncated_fraction"] == 0.0  # the padding row is not a sequence
    assert metrics["rollout_is_weight_mean"] == pytest.approx(math.exp(20.0))


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_token_level_is_the_per_token_correction_bit_for_bit(mode: str) -> None:
    old, rollout, mask = _rows()
    weights, metrics = compute_rollout_correction_weights(old, rollout, mask, mode=mode, threshold=2.0)
    explicit, explicit_metrics = compute_rollout_correction_weights(old, rollout, mask, mode=mode, threshold=2.0,
                                                                    level="token")
    assert torch.equal(weights, explicit) and metrics == explicit_metrics
    # the per-token formula, written out: ρ_t = exp(clamp(old − rollout, ±20)), cut per token, 0 on padding
    ratio = torch.exp(torch.clamp(old - rollout, min=-20.0, max=20.0))
    if mode == "tis":
        expected = torch.clamp(ratio, max=2.0)
    else:
        expected = torch.where((ratio <= 2.0) & (ratio >= 0.5), ratio, torch.zeros_like(ratio))
    assert torch.equal(weights, torch.where(mask, expected, torch.zeros_like(expected)))


def test_a_sequence_level_without_a_correction_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout_correction_level = sequence .* rollout_correction is none"):
        PolicyLossConfig(rollout_correction_level="sequence")
    with pytest.raises(ConfigError, match="rollout_correction_level must be one of token, sequence, geometric"):
        PolicyLossConfig(rollout_correction="tis", rollout_correction_level="row")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction_level = geometric .* Fix: set "
                                          r"algorithm\.rollout_correction=tis or mis"):
        load_config(None, ["algorithm.rollout_correction_level=geometric"])
    config = load_config(None, ["actor.recompute_log_probs=true", "algorithm.rollout_correction=mis",
                                "algorithm.rollout_correction_level=sequence"])
    loss = next(plan.spec.loss for plan in plan_roles(config, GRPO().roles(config),
                                                      tokenizer=build_tokenizer(config.model)) if plan.role == "actor")
    assert isinstance(loss, ActorLoss)  # the key reaches the actor's loss
    assert (loss.config.rollout_correction, loss.config.rollout_correction_level) == ("mis", "sequence")


def test_a_masked_sequence_contributes_no_gradient_through_the_actor_loss() -> None:
    old, rollout, mask = _rows()
    old, rollout = old.float(), rollout.float()
    batch = Batch({"old_log_probs": old, "rollout_log_probs": rollout, "advantages": torch.ones_like(old),
                   "response_mask": mask.long()})
    loss_fn = make_actor_loss_fn(PolicyLossConfig(rollout_correction="mis", rollout_correction_level="sequence"))
    log_probs = old.clone().requires_grad_(True)  # ratio π/π_old = 1: inside the clip, gradient −A·w/T per token
    loss, metrics = loss_fn({"log_probs": log_probs}, batch)
    loss.backward()
    assert log_probs.grad is not None
    tokens = int(mask.sum())  # token-mean over all 9 valid tokens: a masked row still counts in the denominator
    grad = (-log_probs.grad * tokens).tolist()
    # row 0: ρ = 1.8 on its two tokens; rows 1 (ρ = 3.75) and 2 (ρ = 0.075) masked whole; padding 0
    assert grad[0] == pytest.approx([1.8, 1.8, 0.0, 0.0])
    assert grad[1] == [0.0] * 4 and grad[2] == [0.0] * 4
    assert metrics["actor/rollout_is_masked_fraction"] == pytest.approx(2 / 3)
    assert metrics["actor/rollout_is_weight_mean"] == pytest.approx(1.8 / 3)


def test_rollout_probs_diff_is_the_token_probability_gap_over_valid_tokens() -> None:
    rollout = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    old = torch.tensor([[math.log(0.4), math.log(0.2), math.log(0.1)]])
    metrics = compute_rollout_probs_diff(rollout, old, torch.tensor([[1, 1, 0]]))
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.05)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.1)
