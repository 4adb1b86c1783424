"""The RLHF dataflows the placement search schedules (stages, their models, dependencies) and the workload.

Stage names match the ledger's node names. This module only describes the graph; timing is the simulator's job and
running it is the controller's.
Stability: developer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridflow.errors import ConfigError

__all__ = ["Workload", "Stage", "Dataflow", "get_dataflow", "ALGORITHMS", "ROLE_CONFIG_KEYS", "StageKind"]

StageKind = Literal["generate", "infer", "train", "transition"]

ROLE_CONFIG_KEYS: dict[str, str] = {
    "actor": "actor",
    "critic": "critic",
    "reference": "reference",
    "reward": "reward",
    "cost": "cost",
}


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


def get_dataflow(algorithm: str) -> Dataflow:
    """Return the dataflow of ``algorithm``; unknown names list the known ones."""
    key = algorithm.lower().replace("-", "_")
    if key not in ALGORITHMS:
        raise ConfigError(f"Unknown algorithm {algorithm!r} for placement. Known: {', '.join(sorted(ALGORITHMS))}.")
    return ALGORITHMS[key]
