"""The ``hybridflow`` command: a thin dispatcher to subcommands that live next to what they drive.

Each subcommand module exposes ``main(argv: list[str]) -> int`` and is imported only when called.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("hybridflow.plugin_listing", "list installed plugins, what they registered and load errors"),
    "train": ("hybridflow.trainer.cli", "run an algorithm from a YAML config plus dotted overrides"),
    "sft": ("hybridflow.trainer.sft", "supervised fine-tuning on demonstrations; writes an HF dir for model.path"),
    "rm": ("hybridflow.trainer.rm", "reward-model training on chosen/rejected pairs; writes an HF dir for "
           "reward.model.path"),
    "report": ("hybridflow.report", "render plots and a summary of a run directory"),
    "export": ("hybridflow.export", "write a Hugging Face model directory from a run's checkpoint"),
    "plan": ("hybridflow.placement.cli", "search placements and parallel sizes (auto device mapping)"),
}


def _usage() -> str:
    lines = ["usage: hybridflow COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if args[0] in {"-V", "--version"}:
        from hybridflow import __version__

        print(f"hybridflow {__version__}")
        return 0
    command = args[0]
    if command not in SUBCOMMANDS:
        import difflib

        close = difflib.get_close_matches(command, list(SUBCOMMANDS), n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        print(f'hybridflow: unknown command "{command}". Known: {", ".join(SUBCOMMANDS)}.{hint}', file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
