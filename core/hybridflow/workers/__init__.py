"""The core's SPMD worker classes: actor (training + rollout in one process, the hybrid engine), critic, reference
and reward model. Each builds its engines by registry name inside its own process; the engines come from plugins.
"""

from hybridflow.workers.roles import (
    ActorRolloutWorker,
    CriticWorker,
    ReferenceWorker,
    RewardModelWorker,
    RoleSpec,
)

__all__ = ["ActorRolloutWorker", "CriticWorker", "ReferenceWorker", "RewardModelWorker", "RoleSpec"]
