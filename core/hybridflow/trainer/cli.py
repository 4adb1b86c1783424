"""``hybridflow train CONFIG.yaml [dotted.key=value ...]``: validate, run, and report errors without tracebacks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridflow.errors import HybridflowError

__all__ = ["main"]


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
    try:
        from hybridflow.config import load_config
        from hybridflow.trainer import Trainer

        config = load_config(config_path, overrides)
        trainer = Trainer(config, progress=not args.no_progress)
        try:
            history = trainer.fit()
        finally:
            trainer.close()
    except HybridflowError as exc:
        print(f"hybridflow train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybridflow train: interrupted; the last checkpoint is intact", file=sys.stderr)
        return 130
    if history:
        first, last = history[0], history[-1]
        print(f"done: {trainer.step} steps; reward/mean {first.get('reward/mean', 0):.3f} → "
              f"{last.get('reward/mean', 0):.3f}; run dir {config.trainer.run_dir}")
        from hybridflow.trainer.capacity import compute_capacity, format_capacity

        print(format_capacity(compute_capacity(history, config.model_dump(mode="json"))))
        if config.trainer.plan is not None:
            from hybridflow.trainer.capacity import advise_placement, format_verdict

            try:
                verdict = advise_placement(Path(config.trainer.run_dir))
            except HybridflowError as exc:
                print(f"placement advisor: not available ({type(exc).__name__}: {exc})")
            else:
                if verdict is not None:
                    print(format_verdict(verdict))
    validated = trainer.validation_history
    for key in sorted({k for row in validated for k in row if k.startswith("val-core/") and k.endswith("@1")}):
        points = [(int(row["step"]), row[key]) for row in validated if key in row]
        print(f"validation {key.removeprefix('val-core/')} (greedy): " + " → ".join(
            f"{value:.2f} @ step {step}" for step, value in points))
    return 0
