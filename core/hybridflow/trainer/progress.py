"""Per-step output: a rich progress bar with the headline metrics, metrics as JSONL and the selected loggers.

It formats and writes; what the metrics mean is the algorithm's business.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.trainer.loggers import ScalarLogger

__all__ = ["MetricsWriter", "Progress", "read_metrics"]

HEADLINE = {"reward/mean": "reward", "response/length_mean": "len", "time/step_s": "step_s", "grad_norm": "grad_norm",
            "actor/entropy": "entropy", "critic/zero_adv_group_ratio": "zero_adv", "kl/actor_ref": "kl",
            "lagrange/lambda": "lambda"}


class MetricsWriter:
    """Appends ``{"step": N, ...metrics}`` to ``metrics.jsonl`` (logger ``jsonl``) and mirrors the scalars to the
    other selected loggers (``tensorboard``, ``wandb``, ``mlflow``; see :mod:`hybridflow.trainer.loggers`).

    ``config`` (the run's config as plain data) is recorded by the loggers that keep one (W&B, MLflow).
    """

    def __init__(self, run_dir: str | Path, *, loggers: Sequence[str] = ("jsonl", "tensorboard"),
                 config: dict[str, Any] | None = None) -> None:
        from hybridflow.trainer.loggers import build_logger

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.loggers = tuple(dict.fromkeys(loggers))
        self.jsonl = "jsonl" in self.loggers
        self.backends: dict[str, ScalarLogger] = {}
        try:
            for name in self.loggers:
                backend = build_logger(name, run_dir, config)
                if backend is not None:
                    self.backends[name] = backend
        except BaseException:
            self.close()
            raise

    @property
    def _tensorboard(self) -> Any:
        return self.backends.get("tensorboard")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.jsonl:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        for backend in self.backends.values():
            backend.log(step, metrics)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        rows = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    def close(self) -> None:
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()


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
