"""The actor loss's KL-to-reference term (GRPO style, ``actor.kl_loss_coef``) written out by hand (issue #41: with the
term's sign flipped the actor loss tests passed; scripts/mutation_check.py's kl_loss_sign)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn
from hybridflow.batch import Batch

COEF = 0.3


def by_hand(kind: str, log_prob: float, ref: float) -> float:
    """Schulman's estimators of KL(π ‖ π_ref) for one sampled token, from its two log-probs."""
    k1 = log_prob - ref
    return {"k1": k1, "abs": abs(k1), "k2": 0.5 * k1 * k1, "k3": math.exp(-k1) + k1 - 1}[kind]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_the_kl_loss_adds_coef_times_the_token_mean_kl_and_pulls_toward_the_reference(kind: str) -> None:
    generator = torch.Generator().manual_seed(7)
    log_probs = (torch.rand(3, 5, generator=generator) * -3).requires_grad_()
    ref = torch.rand(3, 5, generator=generator) * -3
    mask = torch.ones(3, 5)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    batch = Batch({"response_mask": mask, "old_log_probs": log_probs.detach(), "ref_log_probs": ref,
                   "advantages": torch.randn(3, 5, generator=generator)})
    base, _ = make_actor_loss_fn()({"log_probs": log_probs}, batch)
    loss, metrics = make_actor_loss_fn(PolicyLossConfig(kl_loss_coef=COEF, kl_loss_kind=kind))(
        {"log_probs": log_probs}, batch)
    tokens = [(row, column) for row in range(3) for column in range(5) if mask[row, column]]
    values = log_probs.detach()
    expected = sum(by_hand(kind, float(values[t]), float(ref[t])) for t in tokens) / len(tokens)
    assert metrics["actor/kl_loss"] == pytest.approx(expected, rel=1e-5)
    assert float((loss - base).detach()) == pytest.approx(COEF * expected, rel=1e-5)
    # the term's gradient: descending it moves each token's log-prob toward the reference's (k1 lowers every one)
    (gradient,) = torch.autograd.grad(loss - base, log_probs)
    for token in tokens:
        if kind == "k1":
            assert float(gradient[token]) == pytest.approx(COEF / len(tokens), rel=1e-5)
        else:
            assert float(gradient[token]) * float(values[token] - ref[token]) > 0, (kind, token)
    assert not bool(gradient[mask == 0].any())
