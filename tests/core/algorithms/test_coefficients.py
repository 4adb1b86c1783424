"""KL controllers and the Safe-RLHF Lagrange multiplier: direction of updates, bounds, bit-identical resume."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms.coefficients import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    LagrangeMultiplier,
    build_kl_controller,
)
from hybridflow.errors import CheckpointError, ConfigError


def test_fixed_controller_never_moves():
    controller = build_kl_controller("fixed", kl_coef=0.05)
    for kl in (0.0, 1.0, 100.0):
        assert controller.update(kl, 256) == 0.05


@settings(max_examples=50, deadline=None)
@given(st.floats(0.01, 10.0), st.floats(0.01, 10.0), st.floats(0.0, 50.0), st.integers(1, 1000))
def test_adaptive_controller_moves_towards_target(init, target, kl, n_steps):
    controller = AdaptiveKLController(init, target, horizon=1000)
    new = controller.update(kl, n_steps)
    if kl > target * (1 + 1e-9):
        assert new > init  # KL too high: penalise more
    elif kl < target * (1 - 1e-9):
        assert new < init
    assert abs(new / init - 1) <= 0.2 * n_steps / 1000 + 1e-12  # proportional error clipped at ±20 %


def test_adaptive_controller_follows_ziegler_formula():
    controller = AdaptiveKLController(0.1, 6.0, horizon=10_000)
    assert controller.update(6.6, 1000) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert controller.update(60.0, 1000) == pytest.approx(0.1 * 1.01 * (1 + 0.2 * 0.1))


def test_adaptive_controller_closes_the_loop_on_a_kl_that_falls_with_the_coefficient():
    controller = AdaptiveKLController(0.01, 1.0, horizon=100)
    for _ in range(400):
        controller.update(0.05 / controller.value, 10)  # a policy whose KL is inversely proportional to β
    assert 0.05 / controller.value == pytest.approx(1.0, rel=0.02)


def test_lagrange_multiplier_rises_while_cost_exceeds_limit():
    multiplier = LagrangeMultiplier(cost_limit=0.5, lr=0.1, init_value=0.0)
    values = [multiplier.update(1.5) for _ in range(5)]
    assert values == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_lagrange_multiplier_falls_to_exactly_zero_and_stays_there():
    multiplier = LagrangeMultiplier(cost_limit=0.5, lr=0.1, init_value=1.0)
    values = [multiplier.update(-1.0) for _ in range(10)]
    assert all(a > b for a, b in itertools.pairwise(values[:7]))
    assert values[-1] == 0.0 and min(values) >= 0.0


def test_lagrange_multiplier_respects_max_value_and_delay():
    multiplier = LagrangeMultiplier(cost_limit=0.0, lr=1.0, init_value=0.0, max_value=2.5, update_delay=2)
    assert [multiplier.update(1.0) for _ in range(6)] == [0.0, 0.0, 1.0, 2.0, 2.5, 2.5]
    with pytest.raises(ConfigError, match="exceeds max_value"):
        LagrangeMultiplier(cost_limit=0.0, lr=1.0, init_value=3.0, max_value=2.0)
    with pytest.raises(ConfigError, match="lr"):
        LagrangeMultiplier(cost_limit=0.0, lr=0.0)


def test_lagrange_multiplier_drives_cost_to_its_limit_in_a_toy_constrained_problem():
    # Mixture policy: p picks a risky answer (reward 1, cost 1) over a safe one (reward 0.5, cost 0); limit 0.3.
    multiplier = LagrangeMultiplier(cost_limit=0.3, lr=0.05, init_value=0.0)
    p, costs = 0.9, []
    for _ in range(3000):
        p = min(max(p + 0.05 * (0.5 - multiplier.value), 0.0), 1.0)  # ascent on reward − λ·cost
        costs.append(p)
        multiplier.update(p)
    average = sum(costs[-1000:]) / 1000
    assert average == pytest.approx(0.3, abs=0.05) and multiplier.value > 0


def run(controller, inputs, update):
    return [update(controller, value) for value in inputs]


@pytest.mark.parametrize("factory, update", [
    (lambda: FixedKLController(0.2), lambda c, x: c.update(x, 64)),
    (lambda: AdaptiveKLController(0.2, 3.0, horizon=500), lambda c, x: c.update(x, 64)),
    (lambda: LagrangeMultiplier(cost_limit=0.4, lr=0.037, init_value=0.3, update_delay=3),
     lambda c, x: c.update(x)),
])
def test_resume_from_json_state_is_bit_identical(factory, update):
    rng = random.Random(7)
    inputs = [rng.uniform(-1.0, 8.0) for _ in range(40)]
    straight = run(factory(), inputs, update)
    first = factory()
    head = run(first, inputs[:17], update)
    resumed = factory()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + run(resumed, inputs[17:], update) == straight


def test_load_state_dict_rejects_another_controllers_state():
    with pytest.raises(CheckpointError, match="LagrangeMultiplier"):
        LagrangeMultiplier(cost_limit=0.0, lr=0.1).load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(CheckpointError, match="expected keys"):
        FixedKLController(0.1).load_state_dict({"value": 0.1, "surprise": 1})


def test_build_kl_controller_validates():
    assert isinstance(build_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10), AdaptiveKLController)
    with pytest.raises(ConfigError, match="target_kl and horizon"):
        build_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ConfigError, match='"fixed" or "adaptive"'):
        build_kl_controller("pid", kl_coef=0.1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, horizon=0)


def test_adaptive_entropy_control_moves_by_delta_toward_the_target_and_gates_the_bonus_above_it():
    """Skywork-OR1's rule: ± delta per step toward the target entropy, clipped to [0, max]; the bonus the next update
    applies is 0 while the last measured entropy is above the target (so it never pushes entropy past it)."""
    controller = AdaptiveEntropyController(init_coef=0.01, target=0.1, delta=0.004, max_value=0.02)
    assert controller.coefficient() == 0.01  # nothing measured yet: the starting value
    applied = []
    for entropy in (0.05, 0.05, 0.05, 0.5, 0.5, 0.5, 0.5, 0.09):
        controller.update(entropy)
        applied.append(round(controller.coefficient(), 6))
    # below target: 0.014, 0.018, 0.02 (max); above: gated to 0 while the value falls 0.016, 0.012, 0.008, 0.004;
    # below again: the value climbs from where it was (0.008) and applies at once
    assert applied == [0.014, 0.018, 0.02, 0.0, 0.0, 0.0, 0.0, 0.008]
    for _ in range(10):
        controller.update(1.0)
    assert controller.value == 0.0 and controller.coefficient() == 0.0  # clipped at 0, never negative


def test_adaptive_entropy_control_resumes_bit_for_bit_and_checks_its_input():
    controller = AdaptiveEntropyController(init_coef=0.0, target=0.3, delta=0.001)
    for entropy in (0.2, 0.4, 0.1):
        controller.update(entropy)
    restored = AdaptiveEntropyController(init_coef=0.5, target=1.0, delta=0.1)
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert (restored.value, restored.last_entropy, restored.coefficient()) == (
        controller.value, controller.last_entropy, controller.coefficient())
    with pytest.raises(ConfigError, match="actor/entropy must be finite"):
        controller.update(float("nan"))
    with pytest.raises(ConfigError, match=r"outside \[entropy_coef_min, entropy_coef_max\]"):
        AdaptiveEntropyController(init_coef=0.1, target=0.3, delta=0.001, max_value=0.05)
    with pytest.raises(ConfigError, match="below entropy_coef_min"):
        AdaptiveEntropyController(init_coef=0.0, target=0.3, delta=0.001, min_value=0.01)
    with pytest.raises(ConfigError, match="entropy_target must be finite and > 0"):
        AdaptiveEntropyController(init_coef=0.0, target=0.0, delta=0.001)
    with pytest.raises(CheckpointError, match="AdaptiveEntropyController state expected keys"):
        restored.load_state_dict({"kind": "AdaptiveEntropyController", "value": 0.1})


def test_adaptive_entropy_control_with_a_floor_applies_it_above_the_target_and_adds_below():
    """``min_value``: a fixed part of the bonus, applied whatever the entropy; the control moves the coefficient above
    it while the entropy is below the target and back down to it (never under) while above."""
    controller = AdaptiveEntropyController(init_coef=0.01, target=0.1, delta=0.005, min_value=0.01)
    applied = []
    for entropy in (0.5, 0.05, 0.05, 0.5, 0.5, 0.5):
        controller.update(entropy)
        applied.append(round(controller.coefficient(), 6))
    # above: the floor (value stays 0.01); below: 0.015, 0.02; above: the floor applied, value 0.015, 0.01, 0.01
    assert applied == [0.01, 0.015, 0.02, 0.01, 0.01, 0.01]
    assert controller.value == 0.01
