"""Shared helpers for end-to-end runs: a tiny, fast GRPO config on 2 CPU workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config import Config, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"
#: the example validates; the tests built on it compare training rows, so they run without (test_validation.py on)
NO_VALIDATION = ("trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0")


def _tiny_config(run_dir: Path, *overrides: str) -> Config:
    return load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
                                 "trainer.resume=never", *NO_VALIDATION, *overrides])


@pytest.fixture
def tiny_config():  # type: ignore[no-untyped-def]
    """``tiny_config(run_dir, *overrides)`` → GRPO from random init (grpo_arithmetic_scratch.yaml), shortened."""
    return _tiny_config


@pytest.fixture(scope="session", autouse=True)
def _ray_session() -> None:
    from hybridflow.controller import init_ray

    init_ray(num_cpus=4, object_store_memory=300_000_000)
