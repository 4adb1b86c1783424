"""Short GRPO runs on 2 CPU workers for the recovery tests (Ray started once per session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridflow.config import Config, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"


def short_config(run_dir: Path, *overrides: str, faults: list[str] = (), deadlines: dict[str, float] | None = None,
                 steps: int = 4, every: int = 2) -> Config:
    """GRPO from random init (grpo_arithmetic_scratch.yaml): ``steps`` iterations, a checkpoint every ``every``,
    the given faults."""
    return load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
                                 "trainer.resume=never", f"trainer.total_steps={steps}",
                                 f"trainer.checkpoint_every={every}", "trainer.deadline_s=120",
                                 f"reliability.faults={json.dumps(list(faults))}",
                                 f"reliability.deadlines={json.dumps(deadlines or {})}", "trainer.val_every=0",
                                 "trainer.val_n=1", "data.task.num_val_prompts=0", *overrides])


def run_and_export(config: Config, export: Path) -> Any:
    from hybridflow.trainer import Trainer

    trainer = Trainer(config, progress=False)
    try:
        trainer.fit()
        trainer.groups.role("actor").export_hf(str(export))
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module", autouse=True)
def _ray_session() -> None:
    """One local Ray (4 logical CPUs) for the pytest worker, started at the first module that needs it (before the
    module's own fixtures, which may run the trainer) and reused by the next while it fits (tests/local_ray.py; the
    e2e, reliability and controller modules all ask for this shape, so a worker moving between them keeps it)."""
    from local_ray import ensure_local_ray

    ensure_local_ray(num_cpus=4, object_store_memory=300_000_000)
