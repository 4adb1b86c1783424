"""The local Ray of the controller's test modules: 4 logical CPUs on the 2-core box (pools of 0.25-CPU slots prove
fractional placement), the same shape as the e2e and reliability modules' Ray, so a pytest worker going from one
of those modules to a controller module keeps the Ray it has (``tests/local_ray.py`` reuses a Ray with the CPUs asked
for, all free, and restarts it otherwise: a restart costs seconds of wall time and ~10 CPU-seconds of Ray processes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    from local_ray import ensure_local_ray

    ensure_local_ray(num_cpus=4, object_store_memory=300_000_000)
    yield
