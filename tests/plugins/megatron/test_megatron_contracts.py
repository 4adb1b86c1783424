"""The megatron engine against the hybridflow.testing training-engine contract suite, as the fsdp engine runs it.

Megatron keeps its parallel state per process (one torch.distributed group, one model-parallel layout), so each check
runs in its own spawned 1-rank gloo process; the data-parallel check spawns a 1-rank and a 2-rank group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.engines import TrainingEngineConfig
from hybridflow.testing.contracts import TRAINING_CHECKS, check_data_parallel_matches_single
from hybridflow.testing.contracts.spawn import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron


def make_training_engine(role: str, config: TrainingEngineConfig):  # type: ignore[no-untyped-def]
    from hybridflow_megatron.engine import build_megatron_training_engine

    return build_megatron_training_engine(role=role, config=config, device="cpu")


def _run_check(rank: int, world_size: int, name: str, workdir: str) -> None:
    check = next(check for check in TRAINING_CHECKS if check.__name__ == name)
    check(make_training_engine, Path(workdir))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megatron_contracts")


@pytest.mark.parametrize("check", TRAINING_CHECKS, ids=lambda check: check.__name__)
def test_training_contract(check, workdir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run_ranks(_run_check, 1, check.__name__, str(workdir), workdir=tmp_path, timeout_s=240)


def test_two_ranks_match_one_rank(workdir: Path) -> None:
    from hybridflow_megatron.engine import build_megatron_training_engine

    check_data_parallel_matches_single(build_megatron_training_engine, workdir, world_size=2, steps=3, atol=1e-5)
