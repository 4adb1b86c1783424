"""Validation during a real run: verl-named rows before training, every val_every steps and at the end, and not a
single training metric changed by it (same RNG streams, same policy versions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.progress import read_metrics

TIMING = ("time/step_s", "throughput/prompt_response_tokens_per_s")


def _run(config) -> None:  # type: ignore[no-untyped-def]
    fit_and_close(Trainer(config, progress=False))


@pytest.mark.slow
def test_validation_rows_and_unchanged_training(tmp_path: Path, tiny_config) -> None:
    common = ["trainer.total_steps=3", "trainer.checkpoint_every=0", "data.task.num_val_prompts=6",
              "data.task.num_prompts=64"]
    _run(tiny_config(tmp_path / "off", *common))
    _run(tiny_config(tmp_path / "on", *common, "trainer.val_every=2", "trainer.val_n=8"))
    off, on = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    training = [row for row in on if "reward/mean" in row]
    validation = [row for row in on if "reward/mean" not in row]

    def strip(row: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in row.items() if k not in TIMING}

    assert [strip(row) for row in training] == [strip(row) for row in off]
    assert [row["step"] for row in validation] == [0, 2, 3]
    source = "hybridflow/arithmetic"
    for row in validation:
        for key in (f"val-core/{source}/acc/mean@1", f"val-core/{source}/acc/mean@8", f"val-core/{source}/acc/pass@8",
                    f"val-aux/{source}/reward/mean@1", f"val-aux/{source}/acc/pass@4"):
            assert 0.0 <= row[key] <= 1.0, (key, row)
        assert row[f"val-core/{source}/acc/pass@8"] >= row[f"val-core/{source}/acc/mean@8"]
    assert all(k.startswith(("val-core/", "val-aux/", "timing_s/", "step")) for row in validation for k in row)


@pytest.mark.slow
def test_resumed_run_writes_the_validation_rows_of_a_straight_run(tmp_path: Path, tiny_config) -> None:
    common = ["trainer.checkpoint_every=2", "data.task.num_val_prompts=4", "data.task.num_prompts=64",
              "trainer.val_every=2"]
    _run(tiny_config(tmp_path / "straight", "trainer.total_steps=4", *common))
    _run(tiny_config(tmp_path / "resumed", "trainer.total_steps=2", *common))
    _run(tiny_config(tmp_path / "resumed", "trainer.total_steps=4", "trainer.resume=must", *common))
    drop = (*TIMING, "timing_s/testing")

    def rows(run: str) -> list[dict[str, float]]:
        return [{k: v for k, v in row.items() if k not in drop} for row in read_metrics(tmp_path / run)]

    straight = rows("straight")
    assert [row["step"] for row in straight if "reward/mean" not in row] == [0, 2, 4]
    assert rows("resumed") == straight
