"""``hybridflow train CONFIG.yaml [dotted.key=value ...]``: validate, run, and report errors without tracebacks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from hybridflow.errors import HybridflowError

__all__ = ["main", "run_guarded", "fit_and_close", "validation_lines"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Fittable(Protocol[T_co]):
    """A run that ``fit()``s and then must ``close()`` (its workers and pools): a Trainer or an SFTTrainer."""

    def fit(self) -> T_co: ...

    def close(self) -> None: ...


def fit_and_close(trainer: Fittable[T]) -> T:
    """``trainer.fit()``, closing the trainer whatever happens (an error, Ctrl-C)."""
    try:
        return trainer.fit()
    finally:
        trainer.close()


def run_guarded(command: str, run: Callable[[], T], *, interrupted: str) -> tuple[int, T | None]:
    """``(0, run())``; a :class:`HybridflowError` becomes one line on stderr and exit code 2, Ctrl-C ``interrupted``
    and 130 — the commands report errors without tracebacks."""
    try:
        return 0, run()
    except HybridflowError as exc:
        print(f"{command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2, None
    except KeyboardInterrupt:
        print(f"{command}: {interrupted}", file=sys.stderr)
        return 130, None


def validation_lines(validated: Sequence[Mapping[str, float]], include: Callable[[str], bool], *, digits: int,
                     label: str = "") -> list[str]:
    """One line per validation metric ``include`` accepts: its value at each validated step."""
    lines = []
    for key in sorted({k for row in validated for k in row if include(k)}):
        points = [(int(row["step"]), row[key]) for row in validated if key in row]
        lines.append(f"validation {key.removeprefix('val-core/')}{label}: " + " → ".join(
            f"{value:.{digits}f} @ step {step}" for step, value in points))
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow train", description="Run an RL algorithm from a YAML config.")
    parser.add_argument("config", nargs="?", help="YAML config (omit to use the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. actor.optim.lr=1e-4")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    args = parser.parse_args(argv)
    config_path = args.config
    overrides = list(args.overrides)
    if config_path is not None and "=" in config_path:
        overrides.insert(0, config_path)
        config_path = None
    from hybridflow.config import load_config
    from hybridflow.trainer import Trainer

    def run() -> tuple[Trainer, list[dict[str, float]]]:
        trainer = Trainer(load_config(config_path, overrides), progress=not args.no_progress)
        return trainer, fit_and_close(trainer)

    code, result = run_guarded("hybridflow train", run, interrupted="interrupted; the last checkpoint is intact")
    if result is None:
        return code
    trainer, history = result
    config = trainer.config
    if history:
        first, last = history[0], history[-1]
        print(f"done: {trainer.step} steps; reward/mean {first.get('reward/mean', 0):.3f} → "
              f"{last.get('reward/mean', 0):.3f}; run dir {config.trainer.run_dir}")
        from hybridflow.trainer.capacity import compute_capacity, format_capacity

        print(format_capacity(compute_capacity(history, config.model_dump(mode="json"))))
        from hybridflow.trainer.capacity import advise_placement, format_verdict

        try:
            verdict = advise_placement(Path(config.trainer.run_dir))
        except HybridflowError as exc:
            print(f"placement advisor: not available ({type(exc).__name__}: {exc})")
        else:
            print(format_verdict(verdict) if verdict is not None else
                  "placement advisor: no plan for this run (placed by hand); trainer.placement=auto searches one "
                  "at start-up, trainer.plan=DIR runs one from `hybridflow plan --output DIR`")
    for line in validation_lines(trainer.validation_history,
                                 lambda k: k.startswith("val-core/") and k.endswith("@1"), digits=2, label=" (greedy)"):
        print(line)
    return 0
