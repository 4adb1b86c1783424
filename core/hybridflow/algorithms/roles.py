"""What an algorithm declares: the model roles it needs (:class:`RoleDeclaration`) and the state it keeps
(:class:`Stateful` objects such as KL controllers and Lagrange multipliers).

The trainer builds, checkpoints and resumes exactly what is declared; building the specs from the config sections
is :mod:`hybridflow.trainer.build`'s business. Stability: public.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybridflow.errors import CheckpointError, ConfigError, PluginValidationError

__all__ = [
    "RoleDeclaration",
    "Stateful",
    "ENGINE_ROLES",
    "actor_role",
    "critic_role",
    "reference_role",
    "teacher_role",
    "reward_model_role",
    "genrm_role",
    "policy_roles",
    "check_algorithm_state",
    "load_algorithm_state",
]

#: the model kinds a training engine builds (``role`` of its factory): the head and the methods it serves
ENGINE_ROLES: tuple[str, ...] = ("actor", "critic", "reference", "reward_model")
#: the model kinds a rollout engine serves alone (no training engine): a generative reward model's judge
ROLLOUT_ROLES: tuple[str, ...] = ("judge",)


@runtime_checkable
class Stateful(Protocol):
    """Algorithm state saved with every checkpoint: ``state_dict()`` must be JSON-serialisable."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RoleDeclaration:
    """One model role of an algorithm.

    Args:
        name: the handle's name (``runtime.<name>``), its checkpoint folder and its ledger node prefix.
        worker: the worker class serving it (one of :mod:`hybridflow.workers` or a third party's).
        section: the config section configuring it: ``actor``, ``critic``, ``reference``, ``reward``, ``cost``,
            ``cost_critic``, or ``roles.<key>`` (a free-form section a third-party algorithm documents).
        engine_role: the engine spec: which model the training engine builds (``actor``, ``critic`` = value head,
            ``reference``, ``reward_model`` = score head), or ``judge``: a rollout engine alone generating a
            generative reward model's verdicts (:mod:`hybridflow.workers.judge`).
        output_key: the column its worker returns, when not the worker's default (a critic's ``values``, a reward
            model's ``scores``): two critics or two reward models in one run need distinct columns.
        seed_offset: added to ``trainer.seed`` for the model's initialisation (presets are random-init).
        defaults_from: a section whose values fill the keys ``section`` leaves unset (``cost_critic`` ← ``critic``).
    """

    name: str
    worker: type[Any]
    section: str
    engine_role: str
    output_key: str | None = None
    seed_offset: int = 0
    defaults_from: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name.startswith("_"):
            raise ConfigError(f"role name must be a Python identifier not starting with '_' (it becomes "
                              f"runtime.<name>), got {self.name!r}")
        if self.engine_role not in ENGINE_ROLES + ROLLOUT_ROLES:
            raise ConfigError(f"role {self.name!r}: engine_role must be one of {list(ENGINE_ROLES + ROLLOUT_ROLES)}, "
                              f"got {self.engine_role!r}")
        if not isinstance(self.worker, type):
            raise ConfigError(f"role {self.name!r}: worker must be a worker class, got {self.worker!r}")


def actor_role() -> RoleDeclaration:
    """The actor: trains the policy and generates (hybrid engine), configured by ``actor`` and ``rollout``."""
    from hybridflow.workers import ActorRolloutWorker

    return RoleDeclaration(name="actor", worker=ActorRolloutWorker, section="actor", engine_role="actor")


def critic_role(name: str = "critic", *, section: str = "critic", defaults_from: str | None = None,
                seed_offset: int = 1, output_key: str | None = None) -> RoleDeclaration:
    """A value model trained on returns (``compute_values``, ``update_critic``)."""
    from hybridflow.workers import CriticWorker

    return RoleDeclaration(name=name, worker=CriticWorker, section=section, engine_role="critic",
                           seed_offset=seed_offset, defaults_from=defaults_from, output_key=output_key)


def reference_role() -> RoleDeclaration:
    """The frozen initial policy (``compute_ref_log_probs``)."""
    from hybridflow.workers import ReferenceWorker

    return RoleDeclaration(name="reference", worker=ReferenceWorker, section="reference", engine_role="reference")


def teacher_role(name: str = "teacher", *, section: str = "roles.teacher", seed_offset: int = 5) -> RoleDeclaration:
    """A frozen policy loaded from a model of its own (on-policy distillation's teacher): the reference's worker and
    engine (``compute_ref_log_probs``, which returns the column ``ref_log_probs``), configured by ``section``, whose
    ``model`` is the teacher's and whose ``pool`` may be the actor's (colocated) or one of its own."""
    from hybridflow.workers import ReferenceWorker

    return RoleDeclaration(name=name, worker=ReferenceWorker, section=section, engine_role="reference",
                           seed_offset=seed_offset)


def reward_model_role(name: str = "reward_model", *, section: str = "reward", output_key: str | None = None,
                      seed_offset: int = 2) -> RoleDeclaration:
    """A scalar-head model scoring responses (``compute_scores`` writes ``output_key``)."""
    from hybridflow.workers import RewardModelWorker

    return RoleDeclaration(name=name, worker=RewardModelWorker, section=section, engine_role="reward_model",
                           output_key=output_key, seed_offset=seed_offset)


def genrm_role(name: str = "genrm", *, section: str = "reward.genrm") -> RoleDeclaration:
    """A generative reward model's judge (``judge`` writes ``genrm_scores``): a causal LM generating verdicts
    through a rollout engine, configured by ``reward.genrm``."""
    from hybridflow.workers.judge import JudgeWorker

    return RoleDeclaration(name=name, worker=JudgeWorker, section=section, engine_role="judge")


def policy_roles(config: Any, *, kl_in_reward: bool, cost: bool = False,
                 critics: Sequence[RoleDeclaration] = ()) -> list[RoleDeclaration]:
    """The roles every policy-gradient driver shares: the actor (then ``critics``); the reference when something
    consumes its log-probs (the KL loss, ``actor.kl_loss_coef > 0``, or the in-reward penalty, ``kl_in_reward``);
    the reward model when ``reward.model`` is set, the judge when ``reward.genrm`` is; with ``cost``, the cost model
    when ``cost.model`` is set."""
    roles = [actor_role(), *critics]
    if config.actor.kl_loss_coef > 0 or kl_in_reward:
        roles.append(reference_role())
    if config.reward.model is not None:
        roles.append(reward_model_role())
    if getattr(config.reward, "genrm", None) is not None:
        roles.append(genrm_role())
    if cost and config.cost is not None and config.cost.model is not None:
        roles.append(reward_model_role("cost_model", section="cost", output_key="costs", seed_offset=4))
    return roles


def check_algorithm_state(algorithm: str, state: Mapping[str, Any]) -> dict[str, Stateful]:
    """The state an algorithm's ``build_state`` returned, checked: string names, objects with ``state_dict`` and
    ``load_state_dict`` whose state is JSON (it goes into ``trainer_state.json``)."""
    checked: dict[str, Stateful] = {}
    for name, item in state.items():
        if not isinstance(name, str) or not isinstance(item, Stateful):
            raise PluginValidationError(
                f"algorithm {algorithm!r}: build_state must map names to objects with state_dict() and "
                f"load_state_dict(state); got {name!r}: {type(item).__name__}")
        try:
            json.dumps(item.state_dict())
        except (TypeError, ValueError) as exc:
            raise PluginValidationError(f"algorithm {algorithm!r}: state {name!r}.state_dict() must be JSON "
                                        f"(numbers, strings, lists, dicts): {exc}") from exc
        checked[name] = item
    return checked


def load_algorithm_state(algorithm: str, state: Mapping[str, Stateful], trainer_state: Mapping[str, Any]) -> None:
    """Restore ``state`` from a checkpoint's trainer state; the saved names must match the declared ones."""
    saved = trainer_state.get("algorithm")
    if saved is None:  # a checkpoint written before algorithms owned their state (top-level keys)
        saved = {name: trainer_state[name] for name in ("kl_controller", "lagrange")
                 if trainer_state.get(name) is not None and name in state}
    missing, extra = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or extra:
        raise CheckpointError(
            f"algorithm {algorithm!r} keeps state {sorted(state)}, but the checkpoint holds {sorted(saved)} "
            f"(missing {missing}, unexpected {extra}); resume with the config that wrote it, or start a new run_dir")
    for name, item in state.items():
        item.load_state_dict(saved[name])
