"""The DeepSpeed plugin's tests build engines in the pytest process itself: each module starts with DeepSpeed holding
no process group of an earlier torch.distributed world (deepspeed_in_process)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _no_stale_deepspeed_groups() -> None:
    from importlib.util import find_spec

    if find_spec("deepspeed") is None:  # the modules that need it skip themselves
        return
    from deepspeed_in_process import release_stale_deepspeed_groups

    release_stale_deepspeed_groups()
