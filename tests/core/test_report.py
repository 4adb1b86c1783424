"""``hybridflow report`` on a run that validated: training rows and validation rows apart, the validation curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.report import main, render_plots, summarize_run


def _write_run(run_dir: Path) -> None:
    rows = [{"step": 0, "val-core/t/acc/mean@1": 0.2, "val-aux/t/reward/mean@1": 0.4, "timing_s/testing": 1.0}]
    for step in range(4):
        rows.append({"step": step, "reward/mean": 0.1 * step, "time/step_s": 2.0})
        if step % 2 == 1:
            rows.append({"step": step + 1, "val-core/t/acc/mean@1": 0.2 + 0.1 * (step + 1),
                         "val-aux/t/reward/mean@1": 0.5, "timing_s/testing": 1.0})
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_report_separates_validation_rows_and_plots_the_curve(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    summary = summarize_run(run_dir)
    assert summary["steps"] == 4 and summary["seconds"] == 8.0  # validation rows are not training steps
    assert summary["reward_first"] == 0.0 and summary["reward_best"] == pytest.approx(0.3)
    assert summary["validation"] == {"val-core/t/acc/mean@1": pytest.approx(
        {"first_step": 0, "first": 0.2, "last_step": 4, "last": 0.6, "best": 0.6})}
    paths = render_plots(run_dir)
    assert run_dir / "validation.png" in paths and (run_dir / "validation.png").stat().st_size > 1000
    assert main([str(run_dir)]) == 0
    assert "val-core/t/acc/mean@1: 0.200 (step 0) → 0.600 (step 4)" in capsys.readouterr().out
