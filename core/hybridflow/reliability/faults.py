"""Fault injection: named points in the workers, the controller and the trainer where a run can be made to die (hard
exit), hang or raise, switched on by ``reliability.faults`` or ``HYBRIDFLOW_FAULTS`` and off by default.

Each fault fires once: a marker file in ``RUN_DIR/faults`` survives the killed process, so a replay or a resumed
run passes the point. Recovering from the fault is :mod:`hybridflow.reliability.recovery`'s business.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from hybridflow.errors import ConfigError, HybridflowError

__all__ = ["FAULT_POINTS", "BUCKET_POINTS", "ENV_VAR", "FaultSpec", "FaultPlan", "InjectedFault", "parse_fault_specs",
           "maybe_fail", "iteration_of_checkpoint"]

#: the environment variable read by the driver (never needed in workers: the plan travels in the role specs)
ENV_VAR = "HYBRIDFLOW_FAULTS"

Side = Literal["worker", "driver"]

#: every injection point: where it fires and in which process
FAULT_POINTS: dict[str, tuple[Side, str]] = {
    "actor.generate": ("worker", "inside ActorRolloutWorker.generate, after the rollout, before returning"),
    "actor.handover": ("worker", "inside the weight handover (rollout engine woken, weights not yet loaded)"),
    "actor.log_probs": ("worker", "inside ActorRolloutWorker.compute_log_probs"),
    "actor.update": ("worker", "inside ActorRolloutWorker.update_policy, after the first optimizer step"),
    "rollout.generate": ("worker", "inside RolloutWorker.generate (a split rollout pool, rollout.pool), after the "
                                   "rollout, before returning"),
    "rollout.load_weights": ("worker", "inside a split rollout pool's weight load (load_weights, or receive_weights "
                                       "with rollout.weight_sync: collective) of policy version ITERATION, buckets "
                                       "0..B-1 in the engine, bucket B (option bucket=B, default 1) not yet"),
    "reference.log_probs": ("worker", "inside ReferenceWorker.compute_ref_log_probs"),
    "critic.values": ("worker", "inside CriticWorker.compute_values"),
    "critic.update": ("worker", "inside CriticWorker.update_critic, after the first optimizer step"),
    "reward_model.scores": ("worker", "inside RewardModelWorker.compute_scores"),
    "checkpoint.worker_write": ("worker", "inside a worker's save_checkpoint, engine state half written"),
    "generate.before_consume": ("driver", "after actor.generate returned, before anything consumed its output: an "
                                          "actor rank is killed"),
    "controller.between_nodes": ("driver", "between two nodes in the controller (iteration done, before the "
                                           "checkpoint or the next iteration): an actor rank is killed"),
    "checkpoint.publish": ("driver", "inside CheckpointManager.save, files written, before the atomic rename: "
                                     "the driver process itself exits"),
}

Action = Literal["kill", "hang", "raise"]
#: points that fire between two buckets of a weight load (option ``bucket=B``: after buckets 0..B-1, before B)
BUCKET_POINTS = {"rollout.load_weights": 1}
_SPEC = re.compile(r"^(?P<point>[a-z_.]+)@(?P<iteration>\d+)(?P<options>(:[a-z=0-9_]+)*)$")


class InjectedFault(HybridflowError):
    """Raised by a fault point whose action is ``raise`` (the other actions exit or hang the process)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultSpec:
    """One fault: ``point`` fires at ``iteration`` on ``rank`` (workers) doing ``action``; a point of
    :data:`BUCKET_POINTS` fires before loading bucket ``bucket`` (None: the point's default)."""

    point: str
    iteration: int
    action: Action = "kill"
    rank: int = 0
    bucket: int | None = None

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            import difflib

            close = difflib.get_close_matches(self.point, list(FAULT_POINTS), n=1)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise ConfigError(f'unknown fault point "{self.point}"; expected one of {", ".join(FAULT_POINTS)}.{hint}')
        if self.action not in ("kill", "hang", "raise"):
            raise ConfigError(f'fault action must be kill, hang or raise; got "{self.action}" for {self.point}')
        if self.iteration < 0 or self.rank < 0:
            raise ConfigError(f"fault {self.point}: iteration and rank must be >= 0, got {self.iteration}, {self.rank}")
        if self.bucket is not None and (self.point not in BUCKET_POINTS or self.bucket < 0):
            raise ConfigError(f"fault {self.point}: option bucket=B (B >= 0) is for the points "
                              f"{', '.join(BUCKET_POINTS)}; got bucket={self.bucket}. Fix: remove it")

    @property
    def fires_at_bucket(self) -> int | None:
        """The bucket a point of :data:`BUCKET_POINTS` fires before (None for the other points)."""
        return self.bucket if self.bucket is not None else BUCKET_POINTS.get(self.point)

    @property
    def label(self) -> str:
        bucket = "" if self.bucket is None else f":bucket={self.bucket}"
        return f"{self.point}@{self.iteration}:{self.action}:rank={self.rank}{bucket}"


def parse_fault_specs(text: str | list[str] | tuple[str, ...]) -> tuple[FaultSpec, ...]:
    """``"actor.update@2,actor.generate@1:hang:rank=1,rollout.load_weights@1:raise:bucket=2"`` → specs. Raises
    :class:`ConfigError` naming the bad one."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = []
    for raw in (item.strip() for item in items):
        if not raw:
            continue
        match = _SPEC.match(raw)
        if match is None:
            raise ConfigError(f'fault "{raw}" is not of the form POINT@ITERATION[:kill|:hang|:raise][:rank=R]'
                              f'[:bucket=B] (e.g. "actor.update@2:kill"); points: {", ".join(FAULT_POINTS)}')
        action: str = "kill"
        rank = 0
        bucket: int | None = None
        for option in filter(None, match["options"].split(":")):
            key, _, value = option.partition("=")
            if key in ("rank", "bucket") and not value.isdigit():
                raise ConfigError(f'fault "{raw}": option {key}= takes a number >= 0, got "{value}"')
            if key == "rank":
                rank = int(value)
            elif key == "bucket":
                bucket = int(value)
            else:
                action = option
        # FaultSpec.__post_init__ rejects an unknown action with the valid ones
        specs.append(FaultSpec(point=match["point"], iteration=int(match["iteration"]), action=cast(Action, action),
                               rank=rank, bucket=bucket))
    return tuple(specs)


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultPlan:
    """The faults of a run and where their fired-markers live (shared by the driver and every worker)."""

    specs: tuple[FaultSpec, ...] = ()
    marker_dir: str = ""
    hang_seconds: float = 3600.0

    @classmethod
    def from_sources(cls, configured: list[str] | tuple[str, ...], run_dir: str | Path,
                     environ: dict[str, str] | None = None) -> FaultPlan:
        """Faults from the config plus ``HYBRIDFLOW_FAULTS`` (both empty: an inactive plan)."""
        env = os.environ if environ is None else environ
        specs = parse_fault_specs(list(configured)) + parse_fault_specs(env.get(ENV_VAR, ""))
        return cls(specs=specs, marker_dir=str(Path(run_dir).resolve() / "faults"))

    @property
    def active(self) -> bool:
        return bool(self.specs)

    def to_json(self) -> str:
        return json.dumps({"specs": [[s.point, s.iteration, s.action, s.rank, s.bucket] for s in self.specs],
                           "marker_dir": self.marker_dir, "hang_seconds": self.hang_seconds})

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        data = json.loads(text)
        specs = tuple(FaultSpec(point=p, iteration=i, action=a, rank=r, bucket=b) for p, i, a, r, b in data["specs"])
        return cls(specs=specs, marker_dir=data["marker_dir"], hang_seconds=float(data["hang_seconds"]))

    def due(self, point: str, *, iteration: int, rank: int | None = None, bucket: int | None = None
            ) -> FaultSpec | None:
        """The spec firing now at ``point`` (not fired before; ``bucket``: before loading that bucket), else None."""
        for spec in self.specs:
            if spec.point != point or spec.iteration != iteration:
                continue
            if rank is not None and spec.rank != rank:
                continue
            if bucket is not None and spec.fires_at_bucket != bucket:
                continue
            if not self._marker(spec).exists():
                return spec
        return None

    def fired(self) -> list[str]:
        """Labels of the faults that fired in this run (read from the markers)."""
        return [spec.label for spec in self.specs if self._marker(spec).exists()]

    def _marker(self, spec: FaultSpec) -> Path:
        bucket = "" if spec.bucket is None else f".bucket{spec.bucket}"
        return Path(self.marker_dir) / f"{spec.point}@{spec.iteration}.{spec.action}.rank{spec.rank}{bucket}.fired"

    def mark(self, spec: FaultSpec) -> None:
        marker = self._marker(spec)
        marker.parent.mkdir(parents=True, exist_ok=True)
        with marker.open("w") as handle:
            handle.write(f"pid {os.getpid()} at {time.time()}\n")
            handle.flush()
            os.fsync(handle.fileno())


def maybe_fail(point: str, *, iteration: int | None, plan: FaultPlan, rank: int | None = None,
               bucket: int | None = None) -> FaultSpec | None:
    """Fire ``point`` if ``plan`` has a fault due there (``bucket``: the bucket about to be loaded, for the points
    of :data:`BUCKET_POINTS`): ``kill`` exits this process at once, ``hang`` sleeps, ``raise`` raises.

    ``plan`` is its owner's (a worker role's, from its spec; the supervisor's, in the driver): there is no
    process-wide plan, so two runs in one process never fire each other's faults. Returns the spec only for driver
    points whose action the caller carries out (killing a worker rank).
    """
    if not plan.active or iteration is None:
        return None
    spec = plan.due(point, iteration=iteration, rank=rank, bucket=bucket)
    if spec is None:
        return None
    plan.mark(spec)
    side = FAULT_POINTS[point][0]
    if spec.action == "raise":
        raise InjectedFault(f"injected fault {spec.label} (reliability.faults / {ENV_VAR}); remove it to run clean")
    if spec.action == "hang":
        deadline = time.monotonic() + plan.hang_seconds
        while time.monotonic() < deadline:  # a stuck worker: only the watchdog notices
            time.sleep(0.5)
        return None
    if side == "worker" or point == "checkpoint.publish":
        os._exit(17)  # a hard death: no cleanup, no exception, exactly like a segfault or OOM kill
    return spec


def iteration_of_checkpoint(path: str) -> int | None:
    """The step of a checkpoint directory being written (``.tmp-step-N-xxxx`` or ``step-N``)."""
    match = re.search(r"step-(\d+)", str(path))
    return int(match.group(1)) if match else None
