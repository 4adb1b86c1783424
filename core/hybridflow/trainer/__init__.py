"""The trainer: config → pools and worker groups → the algorithm's step in a loop, with ledger and checkpoints."""

from hybridflow.trainer.loop import Trainer

__all__ = ["Trainer"]
