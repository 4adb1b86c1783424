"""One local Ray per test module of the controller (2 logical CPUs: pools prove fractional placement)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    from hybridflow.controller import init_ray

    started = not ray.is_initialized()
    init_ray(num_cpus=2, object_store_memory=200_000_000)
    yield
    if started:
        ray.shutdown()
