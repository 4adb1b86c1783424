"""One local Ray per test module of the controller (2 logical CPUs: pools prove fractional placement).

A Ray left running by an earlier module on the same pytest worker (the e2e session's, with 4 CPUs) is shut down
first; the e2e and reliability fixtures start theirs again when their next test needs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    from hybridflow.controller import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2, object_store_memory=200_000_000)
    yield
    ray.shutdown()
