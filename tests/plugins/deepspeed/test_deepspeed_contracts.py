"""The deepspeed engine against the hybridflow.testing training-engine contract suite, for ZeRO stages 1, 2 and 3:
a few steps lower the loss, every role computes its columns, a checkpoint resumes bit-identically, and 2 gloo ranks
match 1 rank step for step (real DeepSpeed on CPU, real HF models)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hybridflow.engines import TrainingEngineConfig
from hybridflow.testing.contracts import TRAINING_CHECKS, data_parallel_failures

pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/setup.sh --all)")
pytestmark = pytest.mark.deepspeed

STAGES = (1, 2, 3)


def _with_stage(config: TrainingEngineConfig, stage: int) -> TrainingEngineConfig:
    return dataclasses.replace(config, extra={**config.extra, "zero_stage": stage})


def build_zero1_engine(*, role: str, config: TrainingEngineConfig, device: str = "cpu"):  # type: ignore[no-untyped-def]
    from hybridflow_deepspeed.plugin import build_deepspeed_training_engine

    return build_deepspeed_training_engine(role=role, config=_with_stage(config, 1), device=device)


def build_zero2_engine(*, role: str, config: TrainingEngineConfig, device: str = "cpu"):  # type: ignore[no-untyped-def]
    from hybridflow_deepspeed.plugin import build_deepspeed_training_engine

    return build_deepspeed_training_engine(role=role, config=_with_stage(config, 2), device=device)


def build_zero3_engine(*, role: str, config: TrainingEngineConfig, device: str = "cpu"):  # type: ignore[no-untyped-def]
    from hybridflow_deepspeed.plugin import build_deepspeed_training_engine

    return build_deepspeed_training_engine(role=role, config=_with_stage(config, 3), device=device)


FACTORIES = {1: build_zero1_engine, 2: build_zero2_engine, 3: build_zero3_engine}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepspeed_contracts")


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"zero{stage}")
@pytest.mark.parametrize("check", TRAINING_CHECKS, ids=lambda check: check.__name__)
def test_training_contract(check, stage: int, workdir: Path) -> None:  # type: ignore[no-untyped-def]
    factory = FACTORIES[stage]
    check(lambda role, config: factory(role=role, config=config, device="cpu"), workdir)


@pytest.fixture(scope="module")
def stage_failures(workdir: Path) -> dict[str, str | None]:
    """The three stages one after the other on one 1-rank and one 2-rank group (DeepSpeed imported once per rank)."""
    return data_parallel_failures({f"zero{stage}": FACTORIES[stage] for stage in STAGES}, workdir, world_size=2,
                                  steps=3, atol=1e-5, timeout_s=720)


@pytest.mark.slow  # one 1-rank and one 2-rank group of spawned processes for all three stages
@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"zero{stage}")
def test_two_ranks_match_one_rank(stage: int, stage_failures: dict[str, str | None]) -> None:
    assert stage_failures[f"zero{stage}"] is None, stage_failures[f"zero{stage}"]
