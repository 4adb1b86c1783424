"""Validation during a real run: verl-named rows before training, every val_every steps and at the end, and not a
single training metric changed by it (same RNG streams, same policy versions); a resumed run writes the validation
rows of the straight run.

One straight run with validation is read by both tests (4 trainer runs in all, not 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.progress import read_metrics
from hybridflow.trainer.timing import is_timing_metric

#: validation every 2 steps of 4, checkpoints at 2 and 4 (the resumed run restarts from step 2)
COMMON = ("trainer.total_steps=4", "trainer.checkpoint_every=2", "data.task.num_val_prompts=6",
          "data.task.num_prompts=64")
VALIDATION = ("trainer.val_every=2", "trainer.val_n=8")


def _run(config) -> None:  # type: ignore[no-untyped-def]
    fit_and_close(Trainer(config, progress=False))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tiny_config: Any) -> Path:
    run_dir = tmp_path_factory.mktemp("validation") / "straight"
    _run(tiny_config(run_dir, *COMMON, *VALIDATION))
    return run_dir


def _rows(run_dir: Path, *drop: str) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if not is_timing_metric(k) and k not in drop}
            for row in read_metrics(run_dir)]


@pytest.mark.slow
def test_validation_rows_and_unchanged_training(tmp_path: Path, tiny_config, straight: Path) -> None:
    _run(tiny_config(tmp_path / "off", *COMMON))  # the same run without validation
    training = [row for row in _rows(straight) if "reward/mean" in row]
    validation = [row for row in read_metrics(straight) if "reward/mean" not in row]
    assert len(training) == 4 and training == _rows(tmp_path / "off")
    assert [row["step"] for row in validation] == [0, 2, 4]
    source = "hybridflow/arithmetic"
    for row in validation:
        for key in (f"val-core/{source}/acc/mean@1", f"val-core/{source}/acc/mean@8", f"val-core/{source}/acc/pass@8",
                    f"val-aux/{source}/reward/mean@1", f"val-aux/{source}/acc/pass@4"):
            assert 0.0 <= row[key] <= 1.0, (key, row)
        assert row[f"val-core/{source}/acc/pass@8"] >= row[f"val-core/{source}/acc/mean@8"]
    assert all(k.startswith(("val-core/", "val-aux/", "timing_s/", "step")) for row in validation for k in row)


@pytest.mark.slow
def test_resumed_run_writes_the_validation_rows_of_a_straight_run(tmp_path: Path, tiny_config, straight: Path) -> None:
    resumed = tmp_path / "resumed"
    _run(tiny_config(resumed, *COMMON, *VALIDATION, "trainer.total_steps=2"))
    _run(tiny_config(resumed, *COMMON, *VALIDATION, "trainer.resume=must"))
    rows = _rows(straight, "timing_s/testing")
    assert [row["step"] for row in rows if "reward/mean" not in row] == [0, 2, 4]
    assert _rows(resumed, "timing_s/testing") == rows
