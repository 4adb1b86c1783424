"""The policy losses of the registry (vanilla PPO with its dual clip, GSPO, CISPO) and the four aggregations, each
against values worked out here from its formula on small tensors, with where gradients flow and where they must not;
and each reached from the config through the trainer's build (``plan_roles``) to the actor's loss function."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hybridflow.algorithms.grpo import GRPO
from hybridflow.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ActorLoss,
    PolicyLossConfig,
    aggregate_loss,
    cispo_policy_loss,
    compute_loss_scale,
    get_policy_loss,
    gspo_policy_loss,
    make_actor_loss_fn,
    register_policy_loss,
)
from hybridflow.batch import Batch
from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.trainer.build import build_tokenizer, plan_roles

torch.set_num_threads(1)


def _leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def _grad(tensor: torch.Tensor) -> list[list[float]]:
    assert tensor.grad is not None
    grad: list[list[float]] = tensor.grad.tolist()
    return grad


# ---------------------------------------------------------------------------------------------------- the registry


def test_the_registry_holds_verls_names_and_refuses_an_unknown_one_listing_them() -> None:
    assert {"vanilla", "gspo", "cispo"} <= set(POLICY_LOSSES)
    assert get_policy_loss("gspo") is gspo_policy_loss and get_policy_loss("cispo") is cispo_policy_loss
    with pytest.raises(ConfigError, match=r'loss_mode must be one of vanilla, gspo, cispo.*; got "gpso"\. Fix'):
        get_policy_loss("gpso")
    with pytest.raises(ConfigError, match=r'got "ppo"'):
        PolicyLossConfig(loss_mode="ppo")
    with pytest.raises(ConfigError, match="registered already"):
        register_policy_loss("gspo")(cispo_policy_loss)


def test_a_registered_loss_is_the_one_the_actor_computes() -> None:
    calls: list[dict[str, Any]] = []

    @register_policy_loss("test-constant")
    def constant(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, **options: Any) -> tuple[torch.Tensor, dict[str, float]]:
        calls.append(options)
        return (log_probs * 0).sum() + 7.0, {"pg_loss": 7.0}

    try:
        batch = Batch({"response_mask": torch.ones(1, 2), "old_log_probs": torch.zeros(1, 2),
                       "advantages": torch.ones(1, 2)})
        loss, metrics = make_actor_loss_fn(PolicyLossConfig(loss_mode="test-constant", clip_ratio_high=0.3))(
            {"log_probs": torch.zeros(1, 2)}, batch)
        assert loss.item() == 7.0 and metrics == {"actor/pg_loss": 7.0}
        assert calls[0]["clip_ratio_high"] == 0.3 and calls[0]["loss_agg"] == "token-mean"
    finally:
        del POLICY_LOSSES["test-constant"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"loss_mode": "gspo", "loss_agg": "seq-mean-token-mean", "dual_clip_c": 3.0}, "loss_mode gspo has none"),
    ({"loss_mode": "cispo", "dual_clip_c": 3.0}, "loss_mode cispo has none"),
    ({"loss_mode": "gspo"}, "set loss_agg to seq-mean-token-mean"),
    ({"loss_mode": "vanilla", "clip_ratio_low": 1.0}, r"clip_ratio_low must be in \[0, 1\)"),
    ({"loss_agg": "seq-mean-token-sum-norm"}, "got loss_scale_factor = None. Fix: pass loss_scale_factor > 0"),
    ({"loss_scale_factor": 8.0}, "but loss_agg is token-mean"),
    ({"dual_clip_c": 1.0}, "must be > 1"),
])
def test_options_a_loss_does_not_take_are_refused_with_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PolicyLossConfig(**kwargs)


def test_cispo_takes_no_lower_bound() -> None:
    PolicyLossConfig(loss_mode="cispo", clip_ratio_low=1.0)  # MiniMax-M1 tunes ε_high only


# ------------------------------------------------------------------------------------------------------------ GSPO


def test_gspo_by_hand() -> None:
    """Four responses, clip 0.2/0.2: s_i = exp(mean_t(log π − log π_old)) over each response's valid tokens; the
    loss is the mean over responses of the mean over tokens of max(−A·s_i, −A·clip(s_i)); the gradient of an
    unclipped token is −A·s_i / (N·|y_i|), the same on every token of the response, and 0 where it is clipped."""
    deltas = [[0.3, -0.1, 0.0], [0.5, 0.4, 0.3], [-0.6, -0.3, 0.0], [0.2, 0.0, 0.1]]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    adv = [2.0, 1.0, -1.0, -1.0]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.5, -2.5], [-1.2, -0.4, -3.0], [-0.9, -1.1, -0.6]],
                       dtype=torch.float64)
    log_probs = (old + torch.tensor(deltas, dtype=torch.float64)).detach().requires_grad_(True)
    advantages = torch.tensor([[a] * 3 for a in adv], dtype=torch.float64)
    old_leaf = old.clone().requires_grad_(True)
    adv_leaf = advantages.clone().requires_grad_(True)
    loss, metrics = gspo_policy_loss(log_probs, old_leaf, adv_leaf, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                     dual_clip_c=None, loss_agg="seq-mean-token-mean", loss_scale=None,
                                     loss_scale_factor=None, token_weights=None)
    loss.backward()

    lengths = [2, 3, 2, 3]
    s = [math.exp(sum(row[:n]) / n) for row, n in zip(deltas, lengths, strict=True)]
    assert s == pytest.approx([math.exp(0.1), math.exp(0.4), math.exp(-0.45), math.exp(0.1)])
    token_loss = [max(-a * si, -a * min(max(si, 0.8), 1.2)) for a, si in zip(adv, s, strict=True)]
    clipped = [min(max(si, 0.8), 1.2) != si for si in s]
    assert clipped == [False, True, True, False]  # s_1 = 1.49 > 1.2 with A > 0, s_2 = 0.64 < 0.8 with A < 0
    assert loss.item() == pytest.approx(sum(token_loss) / 4)  # each response's tokens share its loss
    expected_grad = [[0.0 if clipped[i] else -adv[i] * s[i] / (4 * lengths[i]) if t < lengths[i] else 0.0
                      for t in range(3)] for i in range(4)]
    assert _grad(log_probs) == [pytest.approx(row) for row in expected_grad]
    assert old_leaf.grad is None and adv_leaf.grad is None  # π_old and A are constants
    assert metrics["seq_ratio_mean"] == pytest.approx(sum(s) / 4)
    assert metrics["ratio_mean"] == pytest.approx(sum(n * si for n, si in zip(lengths, s, strict=True)) / 10)
    assert metrics["clipfrac"] == pytest.approx((3 + 2) / 10) and metrics["clipfrac_lower"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(-sum(sum(row[:n]) for row, n in zip(deltas, lengths,
                                                                                       strict=True)) / 10)
    assert metrics["pg_loss"] == pytest.approx(loss.item())


def test_gspo_gradient_is_the_sequence_level_one_not_the_token_ratios() -> None:
    """GSPO-token's gradient equals the gradient of the sequence-level objective −A·s_i with s_i differentiable
    (GSPO's eq. 7), for one advantage per response; PPO's token ratios give another gradient on the same input."""
    log_probs = _leaf([[-0.2, -1.4, -0.9]])
    old = torch.tensor([[-0.25, -1.3, -1.0]], dtype=torch.float64)
    mask, advantages = torch.ones(1, 3), torch.full((1, 3), 1.5, dtype=torch.float64)
    loss, _ = gspo_policy_loss(log_probs, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                               dual_clip_c=None, loss_agg="seq-mean-token-mean", loss_scale=None,
                               loss_scale_factor=None, token_weights=None)
    loss.backward()
    sequence = log_probs.detach().clone().requires_grad_(True)
    (-1.5 * torch.exp((sequence - old).mean())).backward()  # inside the clip range: s = e^0.0167
    assert sequence.grad is not None and log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, sequence.grad)
    token = log_probs.detach().clone().requires_grad_(True)
    (-1.5 * torch.exp(token - old)).mean().backward()
    assert token.grad is not None and not torch.allclose(token.grad, log_probs.grad)


# ----------------------------------------------------------------------------------------------------------- CISPO


def test_cispo_by_hand() -> None:
    """ℓ_t = −sg(clip(ρ_t, 1 − 0.2, 1 + 0.28))·A_t·log π_t, token-mean over 4 tokens; the gradient is −w_t·A_t / 4
    on every token, clipped ones included, with nothing through the weight."""
    log_probs = _leaf([[-0.5, -1.0, 0.0], [-2.0, -0.3, 0.0]])
    old = torch.tensor([[-1.0, -1.1, -9.0], [-1.0, -0.2, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    loss, metrics = cispo_policy_loss(log_probs, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                      dual_clip_c=None, loss_agg="token-mean", loss_scale=None,
                                      loss_scale_factor=None, token_weights=None)
    loss.backward()
    ratio = [math.exp(0.5), math.exp(0.1), math.exp(-1.0), math.exp(-0.1)]
    weight = [1.28, ratio[1], 0.8, ratio[3]]  # ρ = 1.65 and 0.37 are clipped
    a, lp = [1.0, 1.0, -2.0, -2.0], [-0.5, -1.0, -2.0, -0.3]
    assert loss.item() == pytest.approx(sum(-w * ai * li for w, ai, li in zip(weight, a, lp, strict=True)) / 4)
    grad = [-w * ai / 4 for w, ai in zip(weight, a, strict=True)]
    assert _grad(log_probs) == [pytest.approx([grad[0], grad[1], 0.0]), pytest.approx([grad[2], grad[3], 0.0])]
    # a weight that carried gradient would give −A·ρ·(1 + log π) on the unclipped tokens: 0 for token (0, 1)
    assert grad[1] != 0.0
    assert metrics["clipfrac"] == pytest.approx(2 / 4) and metrics["clipfrac_lower"] == 0.0
    assert metrics["clipped_ratio_mean"] == pytest.approx(sum(weight) / 4)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratio) / 4)


def test_cispo_without_a_lower_bound_keeps_the_small_ratio() -> None:
    log_probs = _leaf([[-3.0]])
    loss, metrics = cispo_policy_loss(log_probs, torch.tensor([[-1.0]], dtype=torch.float64),
                                      torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 1),
                                      clip_ratio_low=1.0, clip_ratio_high=0.28, dual_clip_c=None,
                                      loss_agg="token-mean", loss_scale=None, loss_scale_factor=None,
                                      token_weights=None)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(-2.0) * -3.0) and metrics["clipfrac"] == 0.0
    assert _grad(log_probs) == [[pytest.approx(math.exp(-2.0))]]


# ------------------------------------------------------------------------------------------------------- dual clip


def _dual_clip_batch() -> tuple[torch.Tensor, Batch]:
    """Row 0: A = −1, ratios 10, 2, 0.5; row 1: A = +1, ratios 10, 1 (row 1's third token is padding)."""
    ratios = [[10.0, 2.0, 0.5], [10.0, 1.0, 1.0]]
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=torch.float64)
    log_probs = (old + torch.tensor(ratios, dtype=torch.float64).log()).detach().requires_grad_(True)
    batch = Batch({"response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "old_log_probs": old,
                   "advantages": torch.tensor([[-1.0] * 3, [1.0] * 3], dtype=torch.float64)})
    return log_probs, batch


def test_dual_clip_by_hand_through_the_actor_loss() -> None:
    """A < 0: ℓ = min(max(ρ, clip(ρ, 0.8, 1.2)), c) with c = 3 → 3, 2, 0.8; A > 0: no dual clip → −1.2, −1."""
    log_probs, batch = _dual_clip_batch()
    loss, metrics = make_actor_loss_fn(PolicyLossConfig(dual_clip_c=3.0))({"log_probs": log_probs}, batch)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0 + 0.8 - 1.2 - 1.0) / 5)
    # the dual-clipped token and the clipped ones are constants; the others move by −A·ρ / 5
    assert _grad(log_probs) == [pytest.approx([0.0, 2.0 / 5, 0.0]), pytest.approx([0.0, -1.0 / 5, 0.0])]
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # ρ = 10 > c with A < 0
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # ρ = 0.5 (A < 0) and ρ = 10 (A > 0)
    plain, plain_metrics = make_actor_loss_fn()({"log_probs": log_probs}, batch)
    assert plain.item() == pytest.approx((10.0 + 2.0 + 0.8 - 1.2 - 1.0) / 5)
    assert plain_metrics["actor/pg_clipfrac_lower"] == 0.0


# ---------------------------------------------------------------------------------------------------- aggregations


def test_each_aggregation_by_hand() -> None:
    """Two responses of 3 and 1 valid tokens and a row without any (it counts nowhere)."""
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    expected = {
        "token-mean": (1 + 2 + 3 + 4) / 4,
        "seq-mean-token-mean": ((1 + 2 + 3) / 3 + 4) / 2,
        "seq-mean-token-sum": ((1 + 2 + 3) + 4) / 2,
        "seq-mean-token-sum-norm": ((1 + 2 + 3) + 4) / (2 * 5),  # L = 5, a constant, not a row's length
    }
    assert set(expected) == set(LOSS_AGGREGATIONS)
    for mode, value in expected.items():
        factor = 5.0 if mode == "seq-mean-token-sum-norm" else None
        assert aggregate_loss(losses, mask, mode, loss_scale_factor=factor).item() == pytest.approx(value), mode
    # over the mini-batch's count instead (the accumulation convention): 4 rows
    assert aggregate_loss(losses, mask, "seq-mean-token-sum-norm", loss_scale=4.0,
                          loss_scale_factor=5.0).item() == pytest.approx(10 / (4 * 5))
    with pytest.raises(ConfigError, match="got loss_scale_factor = None"):
        aggregate_loss(losses, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match="but loss_agg is seq-mean-token-sum"):
        aggregate_loss(losses, mask, "seq-mean-token-sum", loss_scale_factor=5.0)


def test_sum_norm_gives_every_token_the_same_weight_whatever_its_response_length() -> None:
    """Dr. GRPO's point: with seq-mean-token-mean a token of a long response weighs 1/|y_i|, so long wrong answers
    are penalised less per token; seq-mean-token-sum-norm weighs every token 1 / (N·L)."""
    old = torch.zeros(2, 4, dtype=torch.float64)
    batch = Batch({"response_mask": torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]]), "old_log_probs": old,
                   "advantages": torch.full((2, 4), -1.0, dtype=torch.float64)})
    grads = {}
    for mode, factor in (("seq-mean-token-sum-norm", 8.0), ("seq-mean-token-mean", None)):
        log_probs = old.clone().requires_grad_(True)  # ratio 1: the gradient is −A·(the token's weight)
        loss, metrics = make_actor_loss_fn(PolicyLossConfig(loss_agg=mode, loss_scale_factor=factor))(
            {"log_probs": log_probs}, batch)
        loss.backward()
        grads[mode] = _grad(log_probs)
        assert metrics["actor/pg_loss"] == pytest.approx(loss.item())
    assert grads["seq-mean-token-sum-norm"] == [[1 / 16, 0, 0, 0], [1 / 16] * 4]  # 1 / (2 rows · L = 8)
    assert grads["seq-mean-token-mean"] == [[1 / 2, 0, 0, 0], [1 / 8] * 4]


@pytest.mark.parametrize("config", [
    PolicyLossConfig(loss_mode="gspo", loss_agg="seq-mean-token-mean", clip_ratio_low=0.01, clip_ratio_high=0.01,
                     entropy_coef=0.01, kl_loss_coef=0.1),
    PolicyLossConfig(loss_mode="cispo", clip_ratio_low=1.0, clip_ratio_high=0.1, kl_loss_coef=0.1),
    PolicyLossConfig(loss_mode="cispo", loss_agg="seq-mean-token-sum-norm", loss_scale_factor=6.0),
    PolicyLossConfig(dual_clip_c=1.05, loss_agg="seq-mean-token-sum-norm", loss_scale_factor=6.0, entropy_coef=0.01),
], ids=["gspo", "cispo", "cispo-sum-norm", "dual-clip-sum-norm"])
def test_micro_batch_losses_sum_to_the_mini_batch_loss(config: PolicyLossConfig) -> None:
    """Each loss under the accumulation convention: micro-batches of 1, 2 and 3 rows, each over the mini-batch's
    counts, sum to the whole batch's loss and gradient."""
    generator = torch.Generator().manual_seed(3)
    rows, length = 6, 5
    mask = (torch.arange(length)[None, :] < torch.tensor([5, 1, 3, 0, 4, 2])[:, None]).long()
    batch = Batch({"response_mask": mask,
                   "old_log_probs": -torch.rand(rows, length, generator=generator, dtype=torch.float64),
                   "ref_log_probs": -torch.rand(rows, length, generator=generator, dtype=torch.float64),
                   "advantages": torch.randn(rows, 1, generator=generator, dtype=torch.float64).expand(rows, length)})
    log_probs = batch["old_log_probs"] + 0.1 * torch.randn(rows, length, generator=generator, dtype=torch.float64)
    entropy = torch.rand(rows, length, generator=generator, dtype=torch.float64)
    loss_fn = make_actor_loss_fn(config)

    def total(parts: list[tuple[int, int]], scale: dict[str, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = log_probs.clone().requires_grad_(True)
        summed = torch.zeros((), dtype=torch.float64)
        for start, stop in parts:
            micro = batch.slice(start, stop)
            summed = summed + loss_fn({"log_probs": leaf[start:stop], "entropy": entropy[start:stop]},
                                      micro.with_meta(**scale) if scale else micro)[0]
        summed.backward()
        assert leaf.grad is not None
        return summed, leaf.grad

    full, full_grad = total([(0, rows)], None)
    summed, summed_grad = total([(0, 1), (1, 3), (3, 6)], compute_loss_scale(batch))
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(summed_grad, full_grad)


# ------------------------------------------------------------------------------------ config → build → actor loss


def _actor_loss(*overrides: str) -> ActorLoss:
    config = load_config(None, list(overrides))
    loss = next(plan.spec.loss for plan in plan_roles(config, GRPO().roles(config),
                                                      tokenizer=build_tokenizer(config.model)) if plan.role == "actor")
    assert isinstance(loss, ActorLoss)
    return loss


def test_the_config_keys_reach_the_actor_loss_the_worker_computes() -> None:
    """actor.clip_ratio_c (verl's key; hybridflow's build once dropped it), loss_mode, loss_agg and
    loss_scale_factor, read by plan_roles into the loss function the actor worker is given."""
    dual = _actor_loss("actor.clip_ratio_c=3.0")
    assert dual.config.dual_clip_c == 3.0 and dual.config.loss_mode == "vanilla"
    log_probs, batch = _dual_clip_batch()
    loss, metrics = dual({"log_probs": log_probs}, batch)
    assert loss.item() == pytest.approx((3.0 + 2.0 + 0.8 - 1.2 - 1.0) / 5)  # the by-hand dual clip above
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert _actor_loss().config.dual_clip_c is None  # off unless set (verl defaults to 3.0)

    gspo = _actor_loss("actor.loss_mode=gspo", "actor.loss_agg=seq-mean-token-mean", "actor.clip_ratio_low=3e-4",
                       "actor.clip_ratio_high=4e-4")
    assert (gspo.config.loss_mode, gspo.config.clip_ratio_low, gspo.config.clip_ratio_high) == ("gspo", 3e-4, 4e-4)
    assert "actor/seq_ratio_mean" in gspo({"log_probs": log_probs}, batch.with_meta())[1]
    cispo = _actor_loss("actor.loss_mode=cispo", "actor.clip_ratio_low=1.0")
    assert "actor/clipped_ratio_mean" in cispo({"log_probs": log_probs}, batch)[1]

    # Dr. GRPO: the constant is the longest response the rollout may produce unless the key sets it
    drgrpo = _actor_loss("actor.loss_agg=seq-mean-token-sum-norm", "algorithm.norm_adv_by_std=false",
                         "rollout.max_new_tokens=24")
    assert (drgrpo.config.loss_agg, drgrpo.config.loss_scale_factor) == ("seq-mean-token-sum-norm", 24.0)
    assert _actor_loss("actor.loss_agg=seq-mean-token-sum-norm",
                       "actor.loss_scale_factor=100").config.loss_scale_factor == 100.0
    assert _actor_loss().config.loss_scale_factor is None


@pytest.mark.parametrize(("overrides", "match"), [
    (["actor.loss_mode=gpso"], r"actor\.loss_mode: Input should be 'vanilla', 'gspo' or 'cispo'; given 'gpso'"),
    (["actor.loss_mode=gspo"], r"actor\.loss_agg is token-mean\. Fix: set actor\.loss_agg: seq-mean-token-mean"),
    (["actor.loss_mode=cispo", "actor.clip_ratio_c=3"], r"loss_mode cispo has none.*Fix: remove actor\.clip_ratio_c"),
    (["actor.clip_ratio_c=1.0"], r"actor\.clip_ratio_c: Input should be greater than 1"),
    (["actor.clip_ratio_low=1.0"], r"must be < 1 \(only cispo"),
    (["actor.loss_scale_factor=8"], r"but loss_agg is token-mean.*Fix: set loss_agg: seq-mean-token-sum-norm"),
    (["critic.loss_mode=gspo"], r"critic\.loss_mode: loss_mode is an actor \(policy-loss\) key"),
    (["critic.clip_ratio_c=3"], r"critic\.clip_ratio_c: clip_ratio_c is an actor \(policy-loss\) key"),
    (["reference.clip_ratio_c=3"], r"reference\.clip_ratio_c: the reference is frozen"),
])
def test_the_config_refuses_what_the_loss_would_not_do(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
