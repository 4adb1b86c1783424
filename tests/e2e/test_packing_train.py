"""The trainer with padding removal and token-budget micro-batches (2 FSDP ranks): the first update's loss and
gradient norm equal the padded, fixed-micro-batch run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close


def run(config) -> list[dict[str, float]]:
    return fit_and_close(Trainer(config, progress=False))


@pytest.mark.slow  # two 1-step trainer runs (~30 CPU-seconds with their workers)
def test_packed_token_budget_run_updates_like_the_padded_run(tmp_path: Path, tiny_config) -> None:
    common = ("trainer.total_steps=1", "trainer.checkpoint_every=0")
    padded = run(tiny_config(tmp_path / "padded", *common, "actor.use_remove_padding=false"))
    # rows hold at most 8 prompt + 8 response tokens: a 24-token budget cuts each rank's 32 rows into ~15 forwards
    packed = run(tiny_config(tmp_path / "packed", *common, "actor.use_remove_padding=true",
                             "actor.max_tokens_per_micro_batch=24"))
    assert packed[0]["reward/mean"] == padded[0]["reward/mean"]  # same rollouts (same weights, same seed)
    for key in ("actor/pg_loss", "grad_norm"):
        assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-4, abs=1e-7), key
