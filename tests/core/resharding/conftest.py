"""One gloo cluster of 4 CPU processes shared by the resharding tests (spawning is slow on a 2-core box)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hybridflow.resharding.local_cluster import GlooCluster

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def gloo_cluster() -> Iterator[GlooCluster]:
    """Four ranks in one gloo group; ``run(fn, *args, size=n)`` uses ranks 0..n-1."""
    with GlooCluster(4, timeout=60.0) as cluster:
        yield cluster
