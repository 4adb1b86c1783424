"""The actor's handle as the algorithm sees it in a run with a rollout pool (``rollout.pool``, docs/guide/async.md): its
``generate`` of the step's prompts is answered with the step's rollout from the rollout pool, and its
``update_policy`` is followed by the weight sync and the next generation (:class:`~hybridflow.trainer.async_loop.
AsyncRollout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridflow.controller.decorator import Dispatch

if TYPE_CHECKING:
    from hybridflow.trainer.async_loop import AsyncRollout

__all__ = ["ActorWithRolloutPool", "StepGeneration", "StepUpdate"]


class StepGeneration:
    """``actor.generate`` as the algorithm sees it in a run with a rollout pool: the step's own prompts are answered
    with the step's rollout (version-checked); any other call (validation) goes to the actor."""

    dispatch = Dispatch(protocol="dp_compute", blocking=False, idempotent=True)

    def __init__(self, rollout: AsyncRollout, actor_generate: Any) -> None:
        self._rollout, self._actor_generate = rollout, actor_generate

    def __call__(self, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs.get("greedy") and self._rollout.owns(prompts):
            return self._rollout.claim(prompts)
        return self._actor_generate(prompts, *args, **kwargs)

    def submit(self, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        return self(prompts, *args, **kwargs)

    def with_deadline(self, seconds: float) -> StepGeneration:
        return self


class StepUpdate:
    """``actor.update_policy`` as the algorithm sees it: dispatched as usual, then (a step's first update) the weight
    sync and the next generation are dispatched right behind it (:meth:`AsyncRollout.after_update_dispatched`).
    ``chunked``: ``actor.update_policy_chunk`` of a streamed step, followed by them at its ``final`` chunk only."""

    def __init__(self, rollout: AsyncRollout, actor: Any, bound: Any, *, chunked: bool = False) -> None:
        self._rollout, self._actor, self._bound, self._chunked = rollout, actor, bound, chunked

    @property
    def dispatch(self) -> Dispatch:
        return self._bound.dispatch  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).get()

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        future = self._bound.submit(*args, **kwargs)
        # a streamed step's chunk: the weights are the next version after the final chunk only
        if self._rollout.sync_behind_update and (not self._chunked or kwargs.get("final")):
            self._rollout.after_update_dispatched(self._actor)
        return future

    def with_deadline(self, seconds: float) -> StepUpdate:
        return StepUpdate(self._rollout, self._actor, self._bound.with_deadline(seconds), chunked=self._chunked)


class ActorWithRolloutPool:
    """The actor's handle with ``generate`` answered by :class:`StepGeneration` and ``update_policy`` followed by
    the weight sync (:class:`StepUpdate`); every other method unchanged."""

    def __init__(self, rollout: AsyncRollout, actor: Any) -> None:
        self._actor = actor
        self.generate = StepGeneration(rollout, actor.generate)
        self.update_policy = StepUpdate(rollout, actor, actor.update_policy)
        self.update_policy_chunk = StepUpdate(rollout, actor, actor.update_policy_chunk, chunked=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._actor, name)
