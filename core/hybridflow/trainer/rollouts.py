"""``RUN_DIR/rollouts.jsonl``: a few decoded samples of every step (prompt, response, reward, length, data source,
advantage), so what the model generates can be read while it trains and shown by ``hybridflow report``.

Which rows and how they are decoded is :meth:`hybridflow.algorithms.runtime.Runtime.sample_rows`'; this module
appends, truncates on resume and reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ROLLOUTS_FILE", "RolloutWriter", "read_rollouts"]

ROLLOUTS_FILE = "rollouts.jsonl"


class RolloutWriter:
    """Appends ``{"step": N, ...sample}`` lines; does nothing when ``enabled`` is false (``trainer.log_rollouts=0``)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True) -> None:
        self.path = Path(run_dir) / ROLLOUTS_FILE
        self.enabled = enabled

    def write(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.enabled or not samples:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            for sample in samples:
                handle.write(json.dumps({"step": step, **sample}, default=str, ensure_ascii=False) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop the samples of steps after ``step`` (a resumed run writes them again)."""
        if self.path.exists():
            rows = [row for row in read_rollouts(self.path.parent) if row["step"] <= step]
            self.path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                                 encoding="utf-8")


def read_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    """The samples a run wrote, in order (empty when it wrote none)."""
    path = Path(run_dir) / ROLLOUTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
