"""The actor's PPO update through the fsdp training engine (1 gloo rank, a tiny HF model, verl's actor loss):
clipping engages once an update runs off-policy, and clipped tokens, entropy bonus and KL loss move the weights the
way the formulas say (issue #41).

The from-scratch learning runs take one optimizer step per rollout with the rollout's own log-probs, so their ratio
is ~1 and the clip never engages: a learner with the clip broken passes them. Here the ratio leaves [1 − ε, 1 + ε]
twice: by hand (π_old set to chosen offsets from the engine's own log-probs) and by the engine's own updates (a
batch split into mini-batches, each optimizer step moving the policy the next mini-batch is scored against, then a
second epoch, as ``actor.mini_batch_size`` and ``actor.ppo_epochs`` do). scripts/mutation_check.py runs this file
against each of its mutants.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.algorithms.losses import PolicyLossConfig, make_actor_loss_fn
from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, OptimConfig, TrainingEngineConfig
from hybridflow.testing.contracts.rollout import prepare_model
from hybridflow.testing.contracts.training import build_training_batch
from hybridflow_fsdp.training import FSDPTrainingEngine

CLIP = 0.2  # PolicyLossConfig's default clip_ratio_low / clip_ratio_high (verl's)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model(tmp_path_factory.mktemp("ppo_update"))


def actor(path: Path, *, lr: float) -> FSDPTrainingEngine:
    """A fresh actor from ``path`` (same initial weights every time); no weight decay, no gradient clipping."""
    return FSDPTrainingEngine(role="actor", config=TrainingEngineConfig(
        model=ModelSpec(path=str(path)), optim=OptimConfig(lr=lr, grad_clip=0.0), micro_batch_size=64))


def weights(engine: FSDPTrainingEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.generation_weights()}


def with_columns(batch: Batch, **columns: torch.Tensor) -> Batch:
    out = Batch(batch.tensors.clone(recurse=False), dict(batch.non_tensors), dict(batch.meta))
    for name, tensor in columns.items():
        out[name] = tensor
    return out


def ppo_by_hand(log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """PPO's clipped surrogate written out: (per-token clipped mask, token-mean loss, clip fraction)."""
    ratio = torch.exp(log_probs - old)
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP)
    mask = (clipped > unclipped) & valid
    loss = torch.maximum(unclipped, clipped)[valid].mean()
    return mask, float(loss), float(mask[valid].float().mean())


def test_a_clipped_token_contributes_nothing_and_a_fully_clipped_batch_leaves_the_weights(model_path: Path) -> None:
    """π_old = π · e^(−δ) with δ = ±0.4 (ratio 1.49 / 0.67, outside [0.8, 1.2]) or ±0.1 (inside), by hand: the step
    reports the clip fraction and loss of the formula; its gradient equals that of the same batch with the clipped
    tokens' advantages zeroed (a clipped token's gradient is 0); a batch whose every token is clipped has gradient 0
    and leaves every weight as it was. Without the clip (or with π_old := π) both weights and gradient move."""
    batch = build_training_batch(rows=8, response_length=8, seed=3)
    valid = batch["response_mask"].bool()
    advantages = batch["advantages"]
    log_probs = actor(model_path, lr=1e-2).compute_log_probs(batch)["log_probs"]
    loss_fn = make_actor_loss_fn()

    offsets = torch.tensor([0.4, -0.4, 0.1, -0.1]).repeat(batch["responses"].numel() // 4).view_as(advantages)
    mixed = with_columns(batch, old_log_probs=log_probs - offsets)
    clipped, expected_loss, expected_fraction = ppo_by_hand(log_probs, log_probs - offsets, advantages, valid)
    assert 0.2 < expected_fraction < 0.8, expected_fraction  # both kinds of token in the batch
    metrics = actor(model_path, lr=1e-2).train_step(mixed, loss_fn=loss_fn)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(expected_fraction, abs=1e-6), metrics
    assert metrics["actor/pg_loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6), metrics
    assert metrics["actor/ratio_mean"] == pytest.approx(float(torch.exp(offsets)[valid].mean()), rel=1e-4), metrics
    zeroed = with_columns(mixed, advantages=torch.where(clipped, torch.zeros_like(advantages), advantages))
    reference = actor(model_path, lr=1e-2).train_step(zeroed, loss_fn=loss_fn)
    assert reference["actor/pg_clipfrac"] == 0.0 and reference["grad_norm"] > 0, reference
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), (
        "the clipped tokens moved the gradient", metrics["grad_norm"], reference["grad_norm"])

    # every token on the clipped side for its advantage's sign: A > 0 with ratio 1.49, A < 0 with ratio 0.67
    beyond = torch.where(advantages > 0, torch.full_like(offsets, 0.4), torch.full_like(offsets, -0.4))
    engine = actor(model_path, lr=1e-2)
    before = weights(engine)
    metrics = engine.train_step(with_columns(batch, old_log_probs=log_probs - beyond), loss_fn=loss_fn)
    assert metrics["actor/pg_clipfrac"] == 1.0 and metrics["grad_norm"] == 0.0, metrics
    after = weights(engine)
    moved = {name: float((after[name] - before[name]).abs().max()) for name in before}
    assert not any(moved.values()), f"a fully clipped batch moved the weights: {moved}"


def test_mini_batches_and_a_second_epoch_run_off_policy_and_clip_as_the_formula_says(model_path: Path) -> None:
    """The learning path of ``actor.mini_batch_size`` < batch and ``actor.ppo_epochs`` = 2: π_old is the policy
    before the update (its log-probs, as a rollout's), 16 rows take 4 optimizer steps, so mini-batches 2-4 are scored
    against a policy that already moved: the clip engages (``actor/pg_clipfrac`` > 0, ratios ≠ 1). The second
    epoch's first step (the whole batch) reports exactly the clip fraction and loss of the formula at the weights the
    first epoch left, whose log-probs are read back before it."""
    batch = build_training_batch(rows=16, response_length=8, seed=1)
    valid = batch["response_mask"].bool()
    engine = actor(model_path, lr=2e-2)
    old = engine.compute_log_probs(batch)["log_probs"]
    batch = with_columns(batch, old_log_probs=old)
    loss_fn = make_actor_loss_fn()

    first = engine.train_step(batch, loss_fn=loss_fn, mini_batch_size=4)
    assert first["optimizer_steps"] == 4 and first["actor/pg_clipfrac"] > 0, first
    assert first["actor/ppo_kl"] != 0 and first["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-4), first

    now = engine.compute_log_probs(batch)["log_probs"]
    ratio = torch.exp(now - old)[valid]
    near = ((ratio - (1 - CLIP)).abs() < 1e-4) | ((ratio - (1 + CLIP)).abs() < 1e-4)
    assert not bool(near.any()), "a ratio sits on the clip boundary; pick another seed"
    _, expected_loss, expected_fraction = ppo_by_hand(now, old, batch["advantages"], valid)
    assert expected_fraction > 0.05, expected_fraction  # the first epoch moved the policy past the clip range
    second = engine.train_step(batch, loss_fn=loss_fn)
    assert second["actor/pg_clipfrac"] == pytest.approx(expected_fraction, abs=1e-6), (second, expected_fraction)
    assert second["actor/pg_loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6), (second, expected_loss)
    assert second["actor/ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-4), second


def _mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    return float(values[valid].mean())


def test_the_entropy_bonus_raises_the_entropy_and_the_kl_loss_lowers_the_kl(model_path: Path) -> None:
    """With zero advantages only the extra terms drive a step: ``entropy_coef`` > 0 must raise the policy's mean
    token entropy on the batch, ``kl_loss_coef`` > 0 must lower its k3 KL to a reference policy (another tiny model's
    log-probs). A sign flipped in either term turns the step the other way."""
    batch = build_training_batch(rows=8, response_length=8, seed=2)
    valid = batch["response_mask"].bool()
    zero = torch.zeros_like(batch["advantages"])

    engine = actor(model_path, lr=1e-3)
    start = engine.compute_log_probs(batch, with_entropy=True)
    entropy_batch = with_columns(batch, advantages=zero, old_log_probs=start["log_probs"])
    engine.train_step(entropy_batch, loss_fn=make_actor_loss_fn(PolicyLossConfig(entropy_coef=1.0)))
    entropy_after = engine.compute_log_probs(batch, with_entropy=True)["entropy"]
    rise = _mean(entropy_after, valid) - _mean(start["entropy"], valid)
    assert rise > 1e-4, f"the entropy bonus changed the entropy by {rise:+.2e}; it must raise it"

    reference_path = prepare_model(model_path.parent, seed=1)
    ref = actor(reference_path, lr=1e-3).compute_log_probs(batch)["log_probs"]

    def kl(log_probs: torch.Tensor) -> float:  # k3, as the loss estimates it
        difference = ref - log_probs
        return _mean(torch.exp(difference) - difference - 1, valid)

    engine = actor(model_path, lr=1e-3)
    log_probs = engine.compute_log_probs(batch)["log_probs"]
    kl_batch = with_columns(batch, advantages=zero, old_log_probs=log_probs, ref_log_probs=ref)
    engine.train_step(kl_batch, loss_fn=make_actor_loss_fn(PolicyLossConfig(kl_loss_coef=1.0)))
    fall = kl(log_probs) - kl(engine.compute_log_probs(batch)["log_probs"])
    assert kl(log_probs) > 0.005 and fall > 1e-4, f"the KL loss changed KL(π‖π_ref) {kl(log_probs):.4f} by {-fall:+.2e}"
