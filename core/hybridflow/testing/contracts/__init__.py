"""Contract suites every engine plugin runs against its engines: rollout (:mod:`.rollout`) and training
(:mod:`.training`). Each check is a plain function that takes an engine factory and a scratch directory and raises
``AssertionError`` on a violation, so a plugin's pytest module parametrizes over ``ROLLOUT_CHECKS`` /
``TRAINING_CHECKS``. Stability: public.

They build tiny real models (:mod:`hybridflow.testing.fixtures`) as HF directories and touch no hub; which engine to
build and on which device is the caller's business.
"""

from hybridflow.testing.contracts.rollout import ROLLOUT_CHECKS, RolloutEngineMaker
from hybridflow.testing.contracts.training import (
    TRAINING_CHECKS,
    TrainingEngineMaker,
    check_data_parallel_matches_single,
    data_parallel_failures,
)

__all__ = ["ROLLOUT_CHECKS", "TRAINING_CHECKS", "RolloutEngineMaker", "TrainingEngineMaker",
           "check_data_parallel_matches_single", "data_parallel_failures"]
