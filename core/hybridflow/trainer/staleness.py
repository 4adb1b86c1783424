"""The staleness bound of an asynchronous run (docs/guide/async.md) and the actor plan it needs: every row of a rollout
that reaches the trainer carries the policy version it was generated at (a partial rollout's row: the oldest version
of its tokens, :func:`oldest_token_versions`), and rows more than ``trainer.max_staleness`` versions behind the
weights they would update are dropped with their prompt group (:func:`enforce_staleness`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from hybridflow.batch import Batch
from hybridflow.errors import ConfigError, VersionMismatchError
from hybridflow.trainer.build import RolePlan
from hybridflow.workers.partial_rollout import TOKEN_VERSIONS

__all__ = ["STALENESS_COLUMN", "TOKEN_VERSIONS", "enforce_staleness", "oldest_token_versions",
           "partial_rollout_metrics", "use_weight_exporting_actor"]

#: per-row column of a rollout that reached the trainer: the policy version it was generated at
STALENESS_COLUMN = "rollout_policy_version"


def enforce_staleness(batch: Batch, *, version: int, max_staleness: int) -> tuple[Batch | None, int]:
    """The rows of ``batch`` (tagged per row with :data:`STALENESS_COLUMN`) that may update weights of ``version``:
    a row more than ``max_staleness`` versions behind is dropped with every row of its prompt group (same ``uid``,
    so group advantages stay whole). Returns (the kept rows or None when none is left, rows dropped).

    Raises:
        VersionMismatchError: a row, or a token of a partial rollout (:data:`TOKEN_VERSIONS`), claims a version
            newer than ``version`` (weights that do not exist yet).
    """
    versions = [int(v) for v in batch[STALENESS_COLUMN].tolist()]
    newest = max(versions, default=version)
    if TOKEN_VERSIONS in batch and len(batch):
        newest = max(newest, int(batch[TOKEN_VERSIONS].max()))
    if newest > version:
        raise VersionMismatchError(f"a rollout tagged policy_version {newest} reached weights of version "
                                   f"{version}: a sample cannot come from a policy newer than the one it updates")
    stale = [version - v > max_staleness for v in versions]
    if "uid" in batch:
        uids = [str(u) for u in batch["uid"]]
        stale_groups = {uid for uid, is_stale in zip(uids, stale) if is_stale}
        keep = [row for row, uid in enumerate(uids) if uid not in stale_groups]
    else:
        keep = [row for row, is_stale in enumerate(stale) if not is_stale]
    dropped = len(versions) - len(keep)
    if not keep:
        return None, dropped
    return (batch, 0) if not dropped else (batch.index(keep), dropped)


def oldest_token_versions(batch: Batch, fallback: int) -> torch.Tensor:
    """Per row, the oldest version among the response tokens of a partial rollout (:data:`TOKEN_VERSIONS`, -1 on
    padding): the version its staleness is counted by. ``fallback`` for a row without tokens."""
    versions = batch[TOKEN_VERSIONS].long()
    sampled = versions >= 0
    oldest = torch.where(sampled, versions, torch.full_like(versions, torch.iinfo(torch.long).max)).amin(dim=1)
    return torch.where(sampled.any(dim=1), oldest, torch.full_like(oldest, int(fallback)))


def partial_rollout_metrics(batch: Batch, step: int) -> dict[str, float]:
    """A partial rollout's trained rows: the fraction sampled under two or more versions, and the staleness of their
    tokens (mean, max) as the step's weights see it."""
    versions = batch[TOKEN_VERSIONS].long()  # -1 on padding
    sampled = versions >= 0
    mixed = (versions.amax(dim=1) > batch[STALENESS_COLUMN].long()).float()  # newest token newer than the oldest
    token_staleness = (step - versions[sampled]).float()
    return {"async/partial_mixed_version_frac": float(mixed.mean()),
            "async/token_staleness_mean": float(token_staleness.mean()) if token_staleness.numel() else 0.0,
            "async/token_staleness_max": float(token_staleness.max()) if token_staleness.numel() else 0.0}


def use_weight_exporting_actor(plans: list[RolePlan]) -> list[RolePlan]:
    """The plans with the actor served by :class:`~hybridflow.workers.rollout.WeightExportingActor` (a subclass of
    the default actor worker that also exports its generation weights to the rollout pool)."""
    from hybridflow.workers import ActorRolloutWorker
    from hybridflow.workers.rollout import WeightExportingActor

    out = []
    for plan in plans:
        if plan.role == "actor":
            if plan.worker is not ActorRolloutWorker and not issubclass(plan.worker, WeightExportingActor):
                raise ConfigError(f"rollout.pool needs the actor served by the default actor worker (it exports the "
                                  f"weights to the rollout pool); algorithm declares {plan.worker.__qualname__}. "
                                  "Fix: remove rollout.pool, or derive the worker from WeightExportingActor")
            plan = replace(plan, worker=WeightExportingActor)
        out.append(plan)
    return out
