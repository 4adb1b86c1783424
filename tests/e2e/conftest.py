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


@pytest.fixture(scope="session")
def tiny_config():  # type: ignore[no-untyped-def]
    """``tiny_config(run_dir, *overrides)`` → GRPO from random init (grpo_arithmetic_scratch.yaml), shortened."""
    return _tiny_config


def _preset_weight_bytes(preset: str) -> tuple[int, int]:
    """(all weight bytes M, bytes of the replicated norms) of model ``preset``, from its HF model built here (a tied
    embedding / lm_head counted once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.presets import preset_model_config

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**preset_model_config(preset)))
    parameters = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in parameters.values())
    norms = sum(p.numel() * p.element_size() for name, p in parameters.items() if "norm" in name)
    return total, norms


@pytest.fixture
def preset_weight_bytes():  # type: ignore[no-untyped-def]
    """``preset_weight_bytes(preset)`` → (M, replicated norm bytes) of a model preset."""
    return _preset_weight_bytes


@pytest.fixture(scope="module", autouse=True)
def _ray_session() -> None:
    """One local Ray (4 logical CPUs) for the pytest worker, started at the first module that needs it (before the
    module's own fixtures, which may run the trainer) and reused by the next while it fits (tests/local_ray.py; the
    e2e, reliability and controller modules all ask for this shape, so a worker moving between them keeps it)."""
    from local_ray import ensure_local_ray

    ensure_local_ray(num_cpus=4, object_store_memory=300_000_000)
