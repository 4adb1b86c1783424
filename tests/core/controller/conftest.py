"""The local Ray of the controller's test modules (2 logical CPUs: pools prove fractional placement).

The Ray an earlier module left up on the same pytest worker is reused when it has 2 CPUs, all free; otherwise (the
e2e session's, with 4 CPUs) it is shut down and a 2-CPU one started (``tests/local_ray.py``). The e2e and reliability
fixtures do the same with 4 CPUs when their next module needs theirs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    from local_ray import ensure_local_ray

    ensure_local_ray(num_cpus=2, object_store_memory=200_000_000)
    yield
