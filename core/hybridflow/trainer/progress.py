"""Per-step output: a rich progress bar with the headline metrics, metrics as JSONL and TensorBoard scalars.

It formats and writes; what the metrics mean is the algorithm's business.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["MetricsWriter", "Progress", "read_metrics"]

HEADLINE = {"reward/mean": "reward", "response/length_mean": "len", "time/step_s": "step_s", "grad_norm": "grad_norm",
            "actor/entropy": "entropy", "critic/zero_adv_group_ratio": "zero_adv", "kl/actor_ref": "kl",
            "lagrange/lambda": "lambda"}


class MetricsWriter:
    """Appends ``{"step": N, ...metrics}`` to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tensorboard: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            except ImportError:  # tensorboard is an optional extra; JSONL is always written
                self._tensorboard = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, float(value), step)
            self._tensorboard.flush()

    def truncate_after(self, step: int) -> None:
        rows = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class Progress:
    """A rich progress bar showing the headline metrics of the last step (plain lines when not a terminal)."""

    def __init__(self, *, total: int, start: int = 0, enabled: bool = True) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                          TimeElapsedColumn(), TextColumn("{task.fields[metrics]}"))
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, metrics="")
        return self

    def update(self, step: int, metrics: dict[str, float]) -> None:
        text = "  ".join(f"{label}={metrics[key]:.3g}" for key, label in HEADLINE.items() if key in metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=text)
            if not self._progress.console.is_terminal:
                self._progress.console.print(f"step {step}/{self.total}  {text}")

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.__exit__(kind, value, traceback)
