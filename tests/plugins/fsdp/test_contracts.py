"""The fsdp plugin's engines against the hybridflow.testing contract suites (real FSDP2 on gloo, real HF models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.engines import ModelSpec, RolloutEngineConfig, TrainingEngineConfig, training_engine_info
from hybridflow.plugins import load_plugins
from hybridflow.testing.contracts import ROLLOUT_CHECKS, TRAINING_CHECKS, check_data_parallel_matches_single
from hybridflow.testing.contracts.training import check_process_reuse
from hybridflow.testing.fixtures import EOS_ID, PAD_ID
from hybridflow_fsdp.plugin import build_fsdp_training_engine
from hybridflow_fsdp.rollout import build_hf_rollout_engine
from hybridflow_fsdp.training import FSDPTrainingEngine


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp_contracts")


def make_rollout_engine(spec: ModelSpec):
    return build_hf_rollout_engine(config=RolloutEngineConfig(model=spec, pad_token_id=PAD_ID, eos_token_id=EOS_ID))


def make_training_engine(role: str, config: TrainingEngineConfig) -> FSDPTrainingEngine:
    return FSDPTrainingEngine(role=role, config=config, device="cpu")


@pytest.mark.parametrize("check", ROLLOUT_CHECKS, ids=lambda check: check.__name__)
def test_rollout_contract(check, workdir: Path) -> None:
    check(make_rollout_engine, workdir)


@pytest.mark.parametrize("check", TRAINING_CHECKS, ids=lambda check: check.__name__)
def test_training_contract(check, workdir: Path, tmp_path: Path) -> None:
    check(make_training_engine, workdir)


def test_two_ranks_match_one_rank(workdir: Path) -> None:
    check_data_parallel_matches_single(build_fsdp_training_engine, workdir, world_size=2, steps=3, atol=1e-5)


def test_the_declared_process_reuse_holds(workdir: Path, tmp_path: Path) -> None:
    """fsdp declares reusable_process: a second engine in the same process, restored as a parked host restores it,
    trains bit for bit as the first."""
    load_plugins()
    assert training_engine_info("fsdp").reusable_process
    check_process_reuse(make_training_engine, tmp_path)
