"""The megatron engine's side of tests/reliability/test_checkpoint_loads_no_code.py, in its own process (megatron's
parallel state is one per process): build the actor of ``RUN_DIR/manifest.json``'s config on 1 gloo rank, train a
step and save checkpoint ``step-1`` as the trainer does, print ``saved``; then resume from each step directory read
from stdin, printing ``RESULT {json}`` (the error raised, if any) per line, until ``quit``.

Usage: python megatron_resume.py RUN_DIR (MASTER_ADDR and MASTER_PORT set).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from planted import build_actor, resume, train_and_save

from hybridflow.config import Config


def main() -> None:
    run_dir = Path(sys.argv[1])
    config = Config.model_validate(json.loads((run_dir / "manifest.json").read_text())["config"])
    engine = build_actor(config)
    train_and_save(config, engine)
    print("saved", flush=True)
    for line in sys.stdin:
        step_dir = line.strip()
        if step_dir == "quit":
            break
        result: dict[str, str | None] = {"error": None}
        try:
            resume(engine, Path(step_dir))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which checks its type and message
            result = {"error": type(exc).__name__, "message": str(exc), "path": getattr(exc, "path", None),
                      "found": getattr(exc, "found", None)}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
