"""Where a step's generations come from: the one interface the trainer's loop talks to, whatever the rollout mode.

An algorithm's step calls ``actor.generate(prompts)`` and never knows how that call is answered. The trainer asks its
:class:`RolloutSource` instead, around each step: :meth:`~RolloutSource.begin_step` before it (the prompts the step
runs on, and whether its generation began before the step did), :meth:`~RolloutSource.end_step` after it (the
source's metrics), :meth:`~RolloutSource.abort_step` when it failed (to be retried), and the actor handle the step
gets (:meth:`~RolloutSource.wrap_actor`). Two sources ship:

- :class:`ColocatedRollout`: the actor's own workers generate (the 3D-HybridEngine's default). With
  ``trainer.lookahead`` the next iteration's ``actor.generate`` is dispatched behind this step's ``update_policy``,
  so the actor starts generating the moment its update ends instead of after a driver round trip.
- :class:`~hybridflow.trainer.async_loop.AsyncRollout` (``rollout.pool``): a rollout pool generates up to
  ``trainer.max_staleness`` iterations ahead; streaming and partial rollout live behind it too.

:func:`build_rollout_source` picks one from the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from hybridflow.batch import Batch
from hybridflow.config import Config
from hybridflow.data import PromptLoader

if TYPE_CHECKING:
    from hybridflow.reliability import Supervisor
    from hybridflow.trainer.build import Groups, RolePlan
    from hybridflow.trainer.validation import Validation

__all__ = ["ColocatedRollout", "RolloutSource", "StepStart", "build_rollout_source"]


class StepStart(NamedTuple):
    """What :meth:`RolloutSource.begin_step` hands the trainer."""

    #: the prompts the step runs on (the very object a generation dispatched ahead was given, when one was)
    prompts: Batch
    #: whether the step's generation was dispatched before the step began (its time is then timed from the last step)
    overlapped: bool


@runtime_checkable
class RolloutSource(Protocol):
    """The rollout mode behind ``actor.generate``, as the trainer drives it. Stability: experimental."""

    def start(self, groups: Groups, supervisor: Supervisor, *, observers: list[Any], deadline_s: float,
              stack_dump_dir: str | None) -> None:
        """Once, after the run's worker groups are built (before any step)."""
        ...

    def wrap_actor(self, actor: Any) -> Any:
        """The actor handle the algorithm's step gets."""
        ...

    def stream_chunks(self) -> int:
        """Chunks a step streams in (``trainer.stream_mini_batches``); 1 when the step's rollout comes whole."""
        ...

    def begin_step(self, step: int, prompts: Batch, actor: Any) -> StepStart:
        """Before step ``step`` (the actor's weights at version ``step``)."""
        ...

    def end_step(self, step: int, actor: Any) -> dict[str, float]:
        """After step ``step``'s update was dispatched; returns the source's metrics of the step."""
        ...

    def abort_step(self) -> None:
        """Step failed (it will be retried or the run stops): forget what the retry must redo."""
        ...

    def close(self) -> None:
        """At the end of the run."""
        ...


class ColocatedRollout:
    """The actor's workers generate each step's rollout; with ``trainer.lookahead`` the next iteration's generation
    is dispatched behind this step's update. Stability: experimental."""

    def __init__(self, config: Config, loader: PromptLoader, validation: Validation | None) -> None:
        self.config = config
        self.loader = loader
        self.validation = validation
        self.groups: Groups | None = None
        self.supervisor: Supervisor | None = None
        self._step: int | None = None  # the step in flight (an update outside one is a replayed iteration's)
        self._ahead: Batch | None = None  # prompts of the next iteration whose generation was submitted ahead

    def start(self, groups: Groups, supervisor: Supervisor, *, observers: list[Any], deadline_s: float,
              stack_dump_dir: str | None) -> None:
        self.groups, self.supervisor = groups, supervisor
        groups.group_of("actor").before_block = self._submit_generation_ahead

    def wrap_actor(self, actor: Any) -> Any:
        return actor

    def stream_chunks(self) -> int:
        return 1

    def begin_step(self, step: int, prompts: Batch, actor: Any) -> StepStart:
        ahead, self._ahead = self._ahead, None
        self._step = step
        if (ahead is not None and ahead.meta.get("iteration") == prompts.meta.get("iteration")
                and list(ahead.non_tensors.get("uid", [])) == list(prompts.non_tensors.get("uid", []))):
            return StepStart(ahead, True)
        return StepStart(prompts, False)

    def end_step(self, step: int, actor: Any) -> dict[str, float]:
        self._step = None
        return {}

    def abort_step(self) -> None:
        """A retried or stopped iteration starts from a clean slate: no generation stays submitted ahead."""
        self._step = self._ahead = None
        if self.groups is not None:
            for group in self.groups.by_pool.values():
                group.drop_ahead()

    def close(self) -> None:
        self._ahead = None

    def lookahead_allowed(self, step: int) -> bool:
        """Submitting the next generation ahead from inside step ``step`` changes nothing a run can observe when the
        update it queues behind is this step's own (not a recovery replaying an earlier iteration's update), no
        checkpoint is taken after this step (it would capture the rollout engine after that generation) and this is
        not the last step.

        Faults need no gate: the generation is a function of its prompts, the weights version and the iteration's
        seed, so one lost with a failed worker (or failed itself) is redone by the retried iteration."""
        trainer = self.config.trainer
        following = step + 1
        if not trainer.lookahead or self._step != step or following >= trainer.total_steps:
            return False
        if self.validation is not None and self.validation.due(following, trainer.total_steps):
            return False  # validation runs between the steps: this step's time is the step's alone
        return not (trainer.checkpoint_every and following % trainer.checkpoint_every == 0)

    def _submit_generation_ahead(self, role: str, method: str) -> None:
        """``before_block`` of the actor's group: once ``actor.update_policy`` is dispatched, dispatch the next
        iteration's ``actor.generate(prompts)`` behind it."""
        step = self._step
        if (role, method) != ("actor", "update_policy") or self._ahead is not None or step is None \
                or not self.lookahead_allowed(step):
            return
        assert self.groups is not None and self.supervisor is not None
        prompts = self.loader.peek().with_meta(iteration=step + 1, policy_version=step + 1)
        self.groups.group_of("actor").submit_ahead("actor", "generate", prompts,
                                                   deadline_s=self.supervisor.policy.deadlines.get("actor.generate"))
        self._ahead = prompts


def build_rollout_source(config: Config, loader: PromptLoader, plans: list[RolePlan],
                         validation: Validation | None) -> tuple[RolloutSource, list[RolePlan]]:
    """The run's rollout source and its role plans (a rollout pool makes the actor export its weights)."""
    if config.rollout.pool is None:
        return ColocatedRollout(config, loader, validation), plans
    from hybridflow.trainer.async_loop import AsyncRollout, use_weight_exporting_actor

    plans = use_weight_exporting_actor(plans)
    return AsyncRollout(config, loader, plans), plans
