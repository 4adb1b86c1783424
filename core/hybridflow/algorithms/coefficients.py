"""Scalar coefficients an RL driver updates once per iteration: KL coefficient controllers, the adaptive entropy
coefficient and the Safe-RLHF Lagrange multiplier (and :func:`build_kl_state`, the KL controller state an algorithm
declares).

Plain Python floats, so ``state_dict()`` → JSON → ``load_state_dict()`` resumes bit for bit; measuring the KL or
the episode cost and saving the state with the checkpoint are left to the driver. Stability: public.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from hybridflow.algorithms.roles import Stateful
from hybridflow.errors import CheckpointError, ConfigError

__all__ = [
    "FixedKLController",
    "AdaptiveKLController",
    "LagrangeMultiplier",
    "AdaptiveEntropyController",
    "ENTROPY_CONTROLLER",
    "build_entropy_controller",
    "KLController",
    "build_kl_controller",
    "build_kl_state",
]


def _finite(name: str, value: float, *, minimum: float | None = None, strict: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or (minimum is not None and (value <= minimum if strict else value < minimum)):
        bound = "" if minimum is None else f" and {'>' if strict else '≥'} {minimum}"
        raise ConfigError(f"{name} must be finite{bound}, got {value}")
    return value


def _load(owner: str, state: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    missing = [key for key in keys if key not in state]
    extra = [key for key in state if key not in keys and key != "kind"]
    if missing or extra or state.get("kind", owner) != owner:
        raise CheckpointError(
            f"{owner} state expected keys {list(keys)} (kind {owner!r}), got {sorted(state)} "
            f"(kind {state.get('kind')!r}); load the state saved by the same controller type"
        )
    return dict(state)


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing."""

    __slots__ = ("value",)

    def __init__(self, kl_coef: float) -> None:
        self.value = _finite("kl_coef", kl_coef, minimum=0.0)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Return the (unchanged) coefficient."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "FixedKLController", "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(_load("FixedKLController", state, ("value",))["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: move the KL coefficient so the measured KL tracks ``target_kl``.

    ``value ← value · (1 + clip(KL / target − 1, −0.2, 0.2) · n_steps / horizon)``.
    """

    __slots__ = ("value", "target_kl", "horizon")

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = _finite("init_kl_coef", init_kl_coef, minimum=0.0)
        self.target_kl = _finite("target_kl", target_kl, minimum=0.0, strict=True)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon <= 0:
            raise ConfigError(f"horizon must be a positive int (samples over which to adapt), got {horizon!r}")
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt to ``current_kl`` measured over ``n_steps`` samples; return the new coefficient."""
        error = min(max(_finite("current_kl", current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value = self.value * (1.0 + error * n_steps / self.horizon)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "AdaptiveKLController", "value": self.value, "target_kl": self.target_kl,
                "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        loaded = _load("AdaptiveKLController", state, ("value", "target_kl", "horizon"))
        self.value, self.target_kl, self.horizon = float(loaded["value"]), float(loaded["target_kl"]), int(
            loaded["horizon"])


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(
    kind: Literal["fixed", "adaptive"],
    *,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: int | None = None,
) -> KLController:
    """A fixed controller, or an adaptive one (which needs ``target_kl`` and ``horizon``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ConfigError(
                f"an adaptive KL controller needs target_kl and horizon, got target_kl={target_kl}, "
                f"horizon={horizon}; e.g. target_kl=6.0, horizon=10000 (Ziegler et al.)"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ConfigError(f'KL controller kind must be "fixed" or "adaptive", got {kind!r}')


class LagrangeMultiplier:
    """Safe-RLHF's λ ≥ 0 for ``max reward s.t. E[cost] ≤ cost_limit``, by projected gradient ascent on the dual.

    ``λ ← clip(λ + lr · (mean episode cost − cost_limit), 0, max_value)``: λ rises while the cost exceeds its
    limit and decays to exactly 0 once the constraint holds. ``update_delay`` skips the first updates (Safe-RLHF's
    ``lambda_update_delay_steps``).
    """

    __slots__ = ("value", "cost_limit", "lr", "max_value", "update_delay", "steps")

    def __init__(
        self,
        *,
        cost_limit: float,
        lr: float,
        init_value: float = 1.0,
        max_value: float | None = None,
        update_delay: int = 0,
    ) -> None:
        self.cost_limit = _finite("cost_limit", cost_limit)
        self.lr = _finite("lr", lr, minimum=0.0, strict=True)
        self.value = _finite("init_value", init_value, minimum=0.0)
        self.max_value = None if max_value is None else _finite("max_value", max_value, minimum=0.0)
        if self.max_value is not None and self.value > self.max_value:
            raise ConfigError(f"init_value {self.value} exceeds max_value {self.max_value}; lower one or raise the max")
        if isinstance(update_delay, bool) or not isinstance(update_delay, int) or update_delay < 0:
            raise ConfigError(f"update_delay must be an int ≥ 0 (updates to skip), got {update_delay!r}")
        self.update_delay = update_delay
        self.steps = 0

    def update(self, mean_episode_cost: float) -> float:
        """One dual step from this iteration's mean episode cost; return the new λ."""
        cost = _finite("mean_episode_cost", mean_episode_cost)
        self.steps += 1
        if self.steps <= self.update_delay:
            return self.value
        value = max(0.0, self.value + self.lr * (cost - self.cost_limit))
        self.value = value if self.max_value is None else min(value, self.max_value)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "LagrangeMultiplier", "value": self.value, "cost_limit": self.cost_limit, "lr": self.lr,
                "max_value": self.max_value, "update_delay": self.update_delay, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = ("value", "cost_limit", "lr", "max_value", "update_delay", "steps")
        loaded = _load("LagrangeMultiplier", state, keys)
        self.value, self.cost_limit, self.lr = float(loaded["value"]), float(loaded["cost_limit"]), float(loaded["lr"])
        self.max_value = None if loaded["max_value"] is None else float(loaded["max_value"])
        self.update_delay, self.steps = int(loaded["update_delay"]), int(loaded["steps"])


class AdaptiveEntropyController:
    """The entropy bonus's coefficient steered so the policy's token entropy stays near ``target`` (Skywork-OR1's
    adaptive entropy control, arXiv:2505.22312 §3.2): after each update that measured the mean token entropy ``e``,
    ``value ← clip(value + delta·sign(target − e), 0, max_value)``; and :meth:`coefficient`, the bonus the next
    update applies, is ``value`` while the last measured entropy is at most the target and 0 above it — so the bonus
    only ever holds entropy up, never pushes it past the target (a fixed bonus large enough to stop the policy from
    collapsing can instead drive it to uniform noise). ``min_value`` (default 0) is a floor: the coefficient never
    goes below it and is applied above the target too, so ``min_value`` acts as a fixed bonus and the control adds to
    it only while the entropy is below the target.
    """

    __slots__ = ("value", "target", "delta", "min_value", "max_value", "last_entropy")

    def __init__(self, *, init_coef: float, target: float, delta: float, min_value: float = 0.0,
                 max_value: float | None = None) -> None:
        self.value = _finite("entropy_coef", init_coef, minimum=0.0)
        self.target = _finite("entropy_target", target, minimum=0.0, strict=True)
        self.delta = _finite("entropy_coef_delta", delta, minimum=0.0, strict=True)
        self.min_value = _finite("entropy_coef_min", min_value, minimum=0.0)
        self.max_value = None if max_value is None else _finite("entropy_coef_max", max_value, minimum=0.0)
        if self.max_value is not None and not self.min_value <= self.value <= self.max_value:
            raise ConfigError(f"entropy_coef {self.value} (the starting coefficient) lies outside [entropy_coef_min, "
                              f"entropy_coef_max] = [{self.min_value}, {self.max_value}]; move it inside")
        if self.value < self.min_value:
            raise ConfigError(f"entropy_coef {self.value} (the starting coefficient) is below entropy_coef_min "
                              f"{self.min_value}; raise it to at least the floor")
        self.last_entropy: float | None = None

    def coefficient(self) -> float:
        """The entropy bonus coefficient of the next update: ``value``, or ``min_value`` while the entropy is above
        the target."""
        if self.last_entropy is not None and self.last_entropy > self.target:
            return self.min_value
        return self.value

    def update(self, entropy: float) -> float:
        """One step from the mean token entropy an update measured (``actor/entropy``); return the new value."""
        measured = _finite("actor/entropy", entropy, minimum=0.0)
        value = max(self.min_value, self.value + (self.delta if measured < self.target else -self.delta))
        self.value = value if self.max_value is None else min(value, self.max_value)
        self.last_entropy = measured
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "AdaptiveEntropyController", "value": self.value, "target": self.target, "delta": self.delta,
                "min_value": self.min_value, "max_value": self.max_value, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = ("value", "target", "delta", "min_value", "max_value", "last_entropy")
        loaded = _load("AdaptiveEntropyController", state, keys)
        self.value, self.target, self.delta = float(loaded["value"]), float(loaded["target"]), float(loaded["delta"])
        self.min_value = float(loaded["min_value"])
        self.max_value = None if loaded["max_value"] is None else float(loaded["max_value"])
        self.last_entropy = None if loaded["last_entropy"] is None else float(loaded["last_entropy"])


#: the name the trainer keeps an :class:`AdaptiveEntropyController` under, beside the algorithm's own state
ENTROPY_CONTROLLER = "entropy_controller"


def build_entropy_controller(actor: Any) -> AdaptiveEntropyController | None:
    """The adaptive entropy controller ``actor.entropy_target`` asks for (``actor``: the config's actor section), or
    None when the entropy coefficient is fixed."""
    if getattr(actor, "entropy_target", None) is None:
        return None
    return AdaptiveEntropyController(init_coef=actor.entropy_coef, target=actor.entropy_target,
                                     delta=actor.entropy_coef_delta, min_value=actor.entropy_coef_min,
                                     max_value=actor.entropy_coef_max)


def build_kl_state(config: Any) -> dict[str, Stateful]:
    """``{"kl_controller": ...}`` for an algorithm with the in-reward KL penalty when ``algorithm.kl_coef > 0``
    (adaptive with ``algorithm.adaptive_kl_target``, else fixed); ``{}`` when the penalty is off."""
    algorithm = config.algorithm
    if algorithm.kl_coef <= 0:
        if algorithm.adaptive_kl_target is not None:
            raise ConfigError(f"algorithm.adaptive_kl_target={algorithm.adaptive_kl_target} adapts the in-reward KL "
                              "coefficient, but algorithm.kl_coef is 0 (off); set algorithm.kl_coef > 0 (its starting "
                              "value) or remove adaptive_kl_target")
        return {}
    controller = build_kl_controller("adaptive" if algorithm.adaptive_kl_target else "fixed",
                                     kl_coef=algorithm.kl_coef, target_kl=algorithm.adaptive_kl_target, horizon=10_000)
    return {"kl_controller": controller}
