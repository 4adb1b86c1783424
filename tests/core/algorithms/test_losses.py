"""PPO/value losses on constructed examples, KL estimators, and the micro-batch accumulation convention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms.advantages import AlgorithmInputError
from hybridflow.algorithms.losses import (
    KL_KINDS,
    LOSS_AGGREGATIONS,
    PolicyLossConfig,
    ValueLossConfig,
    aggregate_loss,
    compute_loss_scale,
    kl_penalty,
    make_actor_loss_fn,
    make_critic_loss_fn,
    ppo_policy_loss,
    value_loss,
)
from hybridflow.batch import Batch
from hybridflow.errors import ConfigError

torch.set_num_threads(1)


def surrogate(ratios: list[float], advantage: float, **kwargs):
    """Loss, metrics and d loss / d log_probs for one row of tokens with the given ratios and one advantage."""
    old = torch.zeros(1, len(ratios))
    log_probs = torch.log(torch.tensor([ratios])).requires_grad_()
    advantages = torch.full((1, len(ratios)), advantage)
    loss, metrics = ppo_policy_loss(log_probs, old, advantages, torch.ones(1, len(ratios)), **kwargs)
    loss.backward()
    return loss, metrics, log_probs.grad[0]


def test_policy_gradient_raises_log_prob_of_positive_advantage_tokens():
    _, _, positive = surrogate([1.0, 1.0], 2.0)
    _, _, negative = surrogate([1.0, 1.0], -2.0)
    assert torch.all(positive < 0) and torch.all(negative > 0)  # gradient descent moves log π along −grad
    torch.testing.assert_close(positive, torch.full((2,), -1.0))  # −A·ratio / tokens


def test_clipping_fraction_and_zero_gradient_where_clipped():
    ratios = [0.5, 0.9, 1.0, 1.1, 1.5]
    loss, metrics, grad = surrogate(ratios, 1.0)
    assert metrics["clipfrac"] == pytest.approx(1 / 5)  # only 1.5 > 1.2 is clipped for A > 0
    assert grad[4] == 0 and torch.all(grad[:4] != 0)
    assert loss.item() == pytest.approx(-(0.5 + 0.9 + 1.0 + 1.1 + 1.2) / 5)
    _, metrics, grad = surrogate(ratios, -1.0)
    assert metrics["clipfrac"] == pytest.approx(1 / 5)  # only 0.5 < 0.8 is clipped for A < 0
    assert grad[0] == 0 and torch.all(grad[1:] != 0)


def test_asymmetric_clip_range():
    _, metrics, grad = surrogate([1.25, 1.3], 1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert metrics["clipfrac"] == pytest.approx(0.5) and grad[0] != 0 and grad[1] == 0


def test_dual_clip_bounds_negative_advantage_loss():
    loss, metrics, grad = surrogate([10.0], -1.0)
    assert loss.item() == pytest.approx(10.0) and metrics["clipfrac_lower"] == 0
    loss, metrics, grad = surrogate([10.0], -1.0, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0) and metrics["clipfrac_lower"] == 1.0 and grad[0] == 0
    loss, metrics, _ = surrogate([10.0], 1.0, dual_clip_c=3.0)  # no dual clip for A > 0
    assert loss.item() == pytest.approx(-1.2) and metrics["clipfrac_lower"] == 0
    with pytest.raises(ConfigError, match="> 1"):
        surrogate([1.0], -1.0, dual_clip_c=0.5)


def test_approx_kl_and_padding_never_leaks():
    old = torch.tensor([[-1.0, -2.0, float("nan")]])
    log_probs = torch.tensor([[-1.5, -1.0, float("nan")]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = ppo_policy_loss(log_probs, old, advantages, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all() and log_probs.grad[0, 2] == 0
    assert metrics["approx_kl"] == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)


def test_loss_aggregations_by_hand():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(losses, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(losses, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(losses, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(losses, mask, "token-mean", loss_scale=8.0).item() == pytest.approx(10 / 8)
    with pytest.raises(ConfigError, match="token-mean"):
        aggregate_loss(losses, mask, "mean")


def test_value_loss_clipping():
    def run(value: float, clip_range: float | None):
        values = torch.tensor([[value]], requires_grad=True)
        loss, metrics = value_loss(values, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_range=clip_range)
        loss.backward()
        return loss.item(), metrics, values.grad.item()

    loss, metrics, grad = run(0.5, 0.2)  # clipped to 0.2: (0.2 − 1)² > (0.5 − 1)²
    assert loss == pytest.approx(0.5 * 0.64) and metrics["vf_clipfrac"] == 1.0 and grad == 0
    loss, metrics, grad = run(-0.5, 0.2)  # unclipped error is the larger one
    assert loss == pytest.approx(0.5 * 2.25) and metrics["vf_clipfrac"] == 0.0 and grad == pytest.approx(-1.5)
    loss, metrics, grad = run(0.5, None)
    assert loss == pytest.approx(0.5 * 0.25) and grad == pytest.approx(-0.5)


def test_kl_estimators_zero_when_equal_and_k3_nonnegative():
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.randn(4, 5, generator=generator)
    for kind in KL_KINDS:
        assert torch.all(kl_penalty(log_probs, log_probs, kind) == 0)
    assert torch.all(kl_penalty(log_probs, torch.randn(4, 5, generator=generator) * 3, "k3") >= 0)
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 4)
    assert torch.all(kl_penalty(log_probs, log_probs.flip(1), "k2", response_mask=mask)[:, 3:] == 0)
    with pytest.raises(ConfigError, match="k1, k2, k3, abs"):
        kl_penalty(log_probs, log_probs, "k4")


def test_k1_and_k3_estimate_the_true_kl():
    policy = torch.tensor([0.5, 0.3, 0.2])
    reference = torch.tensor([0.2, 0.3, 0.5])
    exact = float((policy * (policy / reference).log()).sum())
    samples = torch.multinomial(policy, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    log_probs, ref_log_probs = policy.log()[samples], reference.log()[samples]
    for kind in ("k1", "k3"):
        assert float(kl_penalty(log_probs, ref_log_probs, kind).mean()) == pytest.approx(exact, rel=0.03)


def make_batch(seed: int, rows: int, length: int) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    batch = Batch({
        "response_mask": mask,
        "old_log_probs": -torch.rand(rows, length, generator=generator, dtype=torch.float64),
        "ref_log_probs": -torch.rand(rows, length, generator=generator, dtype=torch.float64),
        "advantages": torch.randn(rows, length, generator=generator, dtype=torch.float64),
        "values": torch.randn(rows, length, generator=generator, dtype=torch.float64),
        "returns": torch.randn(rows, length, generator=generator, dtype=torch.float64),
    })
    log_probs = -torch.rand(rows, length, generator=generator, dtype=torch.float64)
    entropy = torch.rand(rows, length, generator=generator, dtype=torch.float64)
    values = torch.randn(rows, length, generator=generator, dtype=torch.float64)
    return batch, log_probs, entropy, values


def accumulate(loss_fn, batch, outputs, parts, *, scale: dict[str, float] | None):
    """Σ of loss_fn over micro-batches and the gradient of that sum w.r.t. each output tensor."""
    leaves = {key: value.clone().requires_grad_() for key, value in outputs.items()}
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for part in parts:
        micro = batch.slice(start, start + len(part))
        micro = micro.with_meta(**scale) if scale else micro
        loss, _ = loss_fn({key: leaf[start:start + len(part)] for key, leaf in leaves.items()}, micro)
        total = total + loss
        start += len(part)
    total.backward()
    return total, {key: leaf.grad for key, leaf in leaves.items()}


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 8), st.sampled_from(LOSS_AGGREGATIONS), st.data())
def test_micro_batch_losses_sum_to_the_full_batch_loss(seed, rows, loss_agg, data):
    batch, log_probs, entropy, values = make_batch(seed, rows, 5)
    batch["response_mask"][0, 0] = 1  # an all-padding mini-batch has no loss scale (a clear error, tested elsewhere)
    cuts = sorted(data.draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1)))
    parts = [range(a, b) for a, b in zip([0, *cuts], [*cuts, rows])]
    scale = compute_loss_scale(batch)
    factor = 7.0 if loss_agg == "seq-mean-token-sum-norm" else None  # its constant divisor, refused by the others
    actor = make_actor_loss_fn(PolicyLossConfig(entropy_coef=0.01, kl_loss_coef=0.1, loss_agg=loss_agg,
                                                dual_clip_c=3.0, loss_scale_factor=factor))
    critic = make_critic_loss_fn(ValueLossConfig(loss_agg=loss_agg, coef=0.5, loss_scale_factor=factor))
    for loss_fn, outputs in ((actor, {"log_probs": log_probs, "entropy": entropy}), (critic, {"values": values})):
        full, full_grads = accumulate(loss_fn, batch, outputs, [range(rows)], scale=None)
        summed, summed_grads = accumulate(loss_fn, batch, outputs, parts, scale=scale)
        torch.testing.assert_close(summed, full)
        for key in outputs:
            torch.testing.assert_close(summed_grads[key], full_grads[key])


def test_padded_chunks_contribute_nothing():
    batch, log_probs, _entropy, _ = make_batch(5, 5, 4)
    batch["response_mask"][0, 0] = 1  # at least one token
    actor = make_actor_loss_fn(PolicyLossConfig(kl_loss_coef=0.1))
    full, _ = actor({"log_probs": log_probs}, batch)
    padded = batch.union(Batch({"lp": log_probs})).pad_to_multiple(4)  # 3 padding rows copy the last row
    scale = compute_loss_scale(padded)
    assert scale == compute_loss_scale(batch)
    total = sum(actor({"log_probs": chunk["lp"]}, chunk.with_meta(**scale))[0] for chunk in padded.chunk(2))
    torch.testing.assert_close(total, full)


def test_actor_loss_terms_and_metrics():
    batch, log_probs, entropy, _ = make_batch(2, 3, 4)
    batch["response_mask"][:, 0] = 1
    plain = make_actor_loss_fn()
    base, metrics = plain({"log_probs": log_probs}, batch)
    assert set(metrics) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                            "actor/ratio_mean"} and plain.required_outputs == ("log_probs",)  # verl's names
    with_entropy = make_actor_loss_fn(PolicyLossConfig(entropy_coef=0.5))
    assert with_entropy.required_outputs == ("log_probs", "entropy")
    loss, metrics = with_entropy({"log_probs": log_probs, "entropy": entropy}, batch)
    torch.testing.assert_close(loss, base - 0.5 * aggregate_loss(entropy, batch["response_mask"]))
    assert metrics["actor/entropy"] == pytest.approx(float(aggregate_loss(entropy, batch["response_mask"])))
    with pytest.raises(AlgorithmInputError, match='"entropy"'):
        with_entropy({"log_probs": log_probs}, batch)
    # adaptive entropy control: the batch carries the coefficient of its update, which replaces the configured one
    adaptive = make_actor_loss_fn(PolicyLossConfig(entropy_coef=0.5, adaptive_entropy=True))
    assert make_actor_loss_fn(PolicyLossConfig(adaptive_entropy=True)).required_outputs == ("log_probs", "entropy")
    for coef in (0.0, 0.25):
        loss, metrics = adaptive({"log_probs": log_probs, "entropy": entropy}, batch.with_meta(entropy_coef=coef))
        torch.testing.assert_close(loss, base - coef * aggregate_loss(entropy, batch["response_mask"]))
        assert metrics["actor/entropy_coeff"] == coef
    with pytest.raises(AlgorithmInputError, match='"ref_log_probs"'):
        make_actor_loss_fn(PolicyLossConfig(kl_loss_coef=0.1))({"log_probs": log_probs}, batch.select(
            "response_mask", "old_log_probs", "advantages"))


@pytest.mark.parametrize("kwargs", [
    {"clip_ratio_low": 1.0}, {"clip_ratio_high": -0.1}, {"dual_clip_c": 1.0}, {"kl_loss_coef": -1.0},
    {"kl_loss_kind": "k9"}, {"loss_agg": "sum"}, {"entropy_coef": float("nan")},
])
def test_policy_loss_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        PolicyLossConfig(**kwargs)


def test_value_loss_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="clip_range"):
        ValueLossConfig(clip_range=0.0)
    with pytest.raises(ConfigError, match="coef"):
        ValueLossConfig(coef=0.0)


def test_all_padding_mini_batch_is_a_clear_error():
    batch, log_probs, _, _ = make_batch(1, 3, 4)
    batch["response_mask"].zero_()
    scale = compute_loss_scale(batch)
    assert scale["loss_scale_tokens"] == 0
    with pytest.raises(AlgorithmInputError, match="loss_scale must be > 0"):
        make_actor_loss_fn()({"log_probs": log_probs}, batch.with_meta(**scale))
