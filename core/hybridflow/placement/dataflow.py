"""The RLHF dataflows the placement search schedules (stages, their models, dependencies) and the workload.

The paper's four graphs (ppo, safe_rlhf, grpo, remax) are written out; every other registered algorithm, a plugin's
included, gets the graph its own role declarations describe (:func:`derive_dataflow`). Stage names match the
ledger's node names. This module only describes the graph; timing is the simulator's job and running it is the
controller's.
Stability: developer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridflow.errors import ConfigError

__all__ = ["Workload", "Stage", "Dataflow", "get_dataflow", "derive_dataflow", "ALGORITHMS", "ROLE_CONFIG_KEYS",
           "StageKind", "config_key"]

StageKind = Literal["generate", "infer", "train", "transition"]

ROLE_CONFIG_KEYS: dict[str, str] = {
    "actor": "actor",
    "critic": "critic",
    "reference": "reference",
    "reward": "reward",
    "cost": "cost",
}


def config_key(role: str) -> str:
    """The config section a dataflow role is placed by: the paper's five by name, a derived role by its declared
    section (``cost_critic``, ``roles.safety``)."""
    return ROLE_CONFIG_KEYS.get(role, role)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """One iteration's work: the paper's defaults are 1024 prompts, 1024 prompt and 1024 response tokens."""

    prompts: int = 1024
    samples_per_prompt: int = 1
    prompt_length: int = 1024
    response_length: int = 1024
    ppo_epochs: int = 1
    mini_batches: int = 8
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        for field in ("prompts", "samples_per_prompt", "prompt_length", "response_length", "ppo_epochs",
                      "mini_batches", "micro_batch_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"Workload.{field} must be >= 1, got {getattr(self, field)}.")

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def sequence_length(self) -> int:
        return self.prompt_length + self.response_length


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One node of the dataflow: ``role``'s model does ``kind`` of work after ``after`` finish.

    ``sequence_factor`` scales the workload's sequences (ReMax scores the greedy baseline too).
    """

    name: str
    role: str
    kind: StageKind
    after: tuple[str, ...] = ()
    sequence_factor: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Dataflow:
    """An algorithm's models (``roles``), which of them train, and its stages in dispatch order."""

    algorithm: str
    roles: tuple[str, ...]
    trainable: frozenset[str]
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for stage in self.stages:
            if stage.role not in self.roles:
                raise ConfigError(f"Stage {stage.name!r} uses role {stage.role!r}, not one of {self.roles}.")
            missing = [dep for dep in stage.after if dep not in seen]
            if missing:
                raise ConfigError(f"Stage {stage.name!r} depends on {missing}, which are not earlier stages.")
            seen.add(stage.name)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ConfigError(f"Dataflow {self.algorithm!r} has no stage {name!r}; stages: "
                          f"{', '.join(s.name for s in self.stages)}.")


def _scoring(names: tuple[tuple[str, str], ...], factor: float = 1.0, after: tuple[str, ...] = ("generate",)
             ) -> tuple[Stage, ...]:
    return tuple(Stage(name=n, role=r, kind="infer", after=after, sequence_factor=factor) for n, r in names)


def _ppo(with_cost: bool) -> Dataflow:
    scoring_names = [("old_log_probs", "actor"), ("ref_log_probs", "reference"), ("values", "critic"),
                     ("reward", "reward")]
    if with_cost:
        scoring_names.append(("cost", "cost"))
    scoring = _scoring(tuple(scoring_names))
    scored = tuple(s.name for s in scoring)
    roles = ("actor", "critic", "reference", "reward") + (("cost",) if with_cost else ())
    return Dataflow(
        algorithm="safe_rlhf" if with_cost else "ppo",
        roles=roles,
        trainable=frozenset({"actor", "critic"}),
        stages=(Stage(name="generate", role="actor", kind="generate"), *scoring,
                Stage(name="critic_update", role="critic", kind="train", after=scored),
                Stage(name="actor_update", role="actor", kind="train", after=scored),
                Stage(name="weight_sync", role="actor", kind="transition", after=("actor_update",))),
    )


def _critic_free(algorithm: str, baseline_generation: bool) -> Dataflow:
    generation = [Stage(name="generate", role="actor", kind="generate")]
    factor = 1.0
    if baseline_generation:  # ReMax: a greedy rollout per prompt as the baseline, scored alongside
        generation.append(Stage(name="generate_baseline", role="actor", kind="generate", after=("generate",)))
        factor = 2.0
    ready = (generation[-1].name,)
    scoring = (Stage(name="old_log_probs", role="actor", kind="infer", after=("generate",)),
               Stage(name="ref_log_probs", role="reference", kind="infer", after=("generate",)),
               Stage(name="reward", role="reward", kind="infer", after=ready, sequence_factor=factor))
    scored = tuple(s.name for s in scoring)
    return Dataflow(
        algorithm=algorithm,
        roles=("actor", "reference", "reward"),
        trainable=frozenset({"actor"}),
        stages=(*generation, *scoring,
                Stage(name="actor_update", role="actor", kind="train", after=scored),
                Stage(name="weight_sync", role="actor", kind="transition", after=("actor_update",))),
    )


ALGORITHMS: dict[str, Dataflow] = {
    "ppo": _ppo(with_cost=False),
    "safe_rlhf": _ppo(with_cost=True),
    "grpo": _critic_free("grpo", baseline_generation=False),
    "remax": _critic_free("remax", baseline_generation=True),
}


#: the config that asks an algorithm for every model it can use: the KL term on (a reference) and a reward model
#: (the paper's setting, in which the four written-out graphs place a reward model too)
PLANNING_OVERRIDES: tuple[str, ...] = ("actor.kl_loss_coef=0.001", "reward.model.preset=tiny-qwen2",
                                      "roles.teacher.model.preset=tiny-qwen2")
#: where a scoring stage of each kind goes in dispatch order (the written-out graphs' order)
_SCORING_ORDER = {"old_log_probs": 0, "ref_log_probs": 1, "values": 2, "reward": 3, "cost": 4}


def derive_dataflow(algorithm: str) -> Dataflow:
    """The dataflow of a registered algorithm from the roles it declares for the planning config
    (:data:`PLANNING_OVERRIDES`): the actor generates; the actor's old log-probs, each reference's log-probs, each
    critic's values and each reward or cost model's scores follow the generation; each trainable role (the actor,
    every critic) updates after all scoring, and the weights sync after the actor's update. A run scored by a reward
    function still gets the ``reward`` stage, placed as the paper places its reward model.
    """
    from hybridflow import registries
    from hybridflow.config import load_config
    from hybridflow.plugins import load_plugins

    load_plugins()
    if algorithm not in registries.algorithms:
        known = sorted({*ALGORITHMS, *registries.algorithms.names()})
        raise ConfigError(f"Unknown algorithm {algorithm!r} for placement. Known: {', '.join(known)}.")
    config = load_config(None, [f"algorithm.name={algorithm}", *PLANNING_OVERRIDES])
    declarations = registries.algorithms.get(algorithm).roles(config)
    roles: list[str] = []
    scoring: list[Stage] = [Stage(name="old_log_probs", role="actor", kind="infer", after=("generate",))]
    updates: list[Stage] = []
    for declaration in declarations:
        if declaration.engine_role == "actor":
            roles.insert(0, "actor")
            continue
        role = declaration.section  # the dataflow's role is the config section that places it
        roles.append(role)
        if declaration.engine_role == "reference":
            scoring.append(Stage(name="ref_log_probs" if role == "reference" else f"{declaration.name}_log_probs",
                                 role=role, kind="infer", after=("generate",)))
        elif declaration.engine_role == "critic":
            scoring.append(Stage(name="values" if role == "critic" else f"{declaration.name}_values", role=role,
                                 kind="infer", after=("generate",)))
            updates.append(Stage(name="critic_update" if role == "critic" else f"{declaration.name}_update",
                                 role=role, kind="train"))
        else:
            scoring.append(Stage(name=role if role in ("reward", "cost") else f"{declaration.name}_scores",
                                 role=role, kind="infer", after=("generate",)))
    if "actor" not in roles:
        raise ConfigError(f"algorithm {algorithm!r} declares no actor role; placement plans a policy's dataflow")
    if "reward" not in roles:  # scored by a function: placed as the paper's reward model
        roles.append("reward")
        scoring.append(Stage(name="reward", role="reward", kind="infer", after=("generate",)))
    scoring.sort(key=lambda stage: _SCORING_ORDER.get(stage.name, len(_SCORING_ORDER)))
    scored = tuple(stage.name for stage in scoring)
    updates = [Stage(name=stage.name, role=stage.role, kind="train", after=scored) for stage in updates]
    return Dataflow(
        algorithm=algorithm, roles=tuple(dict.fromkeys(roles)),
        trainable=frozenset({"actor", *(stage.role for stage in updates)}),
        stages=(Stage(name="generate", role="actor", kind="generate"), *scoring, *updates,
                Stage(name="actor_update", role="actor", kind="train", after=scored),
                Stage(name="weight_sync", role="actor", kind="transition", after=("actor_update",))))


def get_dataflow(algorithm: str) -> Dataflow:
    """Return the dataflow of ``algorithm``: the paper's graph for its four, else the one its declared roles
    describe (:func:`derive_dataflow`); unknown names list the known ones."""
    key = algorithm.lower().replace("-", "_")
    if key in ALGORITHMS:
        return ALGORITHMS[key]
    return derive_dataflow(algorithm)
