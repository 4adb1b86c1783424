"""Atomic, checksummed checkpoints: workers write into a temporary directory, the trainer adds its own state and a
checksum list, then one ``rename`` publishes it. A crash mid-write leaves the previous checkpoint untouched.

What goes inside (engine state) is the workers' business; this module only publishes, verifies and prunes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.errors import CheckpointError

__all__ = ["CheckpointManager", "CHECKSUM_FILE", "TRAINER_STATE_FILE", "archive_previous_logs", "RUN_LOGS"]

CHECKSUM_FILE = "checksums.json"
TRAINER_STATE_FILE = "trainer_state.json"
PREFIX = "step-"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Publishes ``RUN_DIR/checkpoints/step-N`` atomically and finds the latest valid one."""

    def __init__(self, run_dir: str | Path, *, keep: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def save(self, step: int, write_workers: Callable[[str], None], trainer_state: dict[str, Any],
             *, before_publish: Callable[[Path], None] | None = None) -> Path:
        """Write a checkpoint for ``step``; ``write_workers(tmp_dir)`` saves the engines into ``tmp_dir``."""
        final = self.root / f"{PREFIX}{step}"
        tmp = self.root / f".tmp-{PREFIX}{step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            write_workers(str(tmp))
            (tmp / TRAINER_STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, sort_keys=True))
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            checksums = {str(p.relative_to(tmp)): _sha256(p) for p in files}
            (tmp / CHECKSUM_FILE).write_text(json.dumps(checksums, indent=1, sort_keys=True))
            for path in files:
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
            if before_publish is not None:
                before_publish(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def _prune(self) -> None:
        for stale in self.root.glob(f".tmp-{PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        steps = self.steps()
        for step in steps[:-self.keep]:
            shutil.rmtree(self.root / f"{PREFIX}{step}", ignore_errors=True)

    def steps(self) -> list[int]:
        out = []
        for path in self.root.glob(f"{PREFIX}*"):
            suffix = path.name.removeprefix(PREFIX)
            if suffix.isdigit() and (path / CHECKSUM_FILE).exists():
                out.append(int(suffix))
        return sorted(out)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"{PREFIX}{steps[-1]}" if steps else None

    def verify(self, path: str | Path) -> dict[str, Any]:
        """Check every file against its checksum; return the trainer state. Raises naming the bad file."""
        path = Path(path)
        checksum_file = path / CHECKSUM_FILE
        if not checksum_file.exists():
            raise CheckpointError(f"checkpoint {path} has no {CHECKSUM_FILE}: it is incomplete; delete it or "
                                  "resume from an earlier one")
        try:
            checksums: dict[str, str] = json.loads(checksum_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{checksum_file} is corrupted ({exc.msg}); delete the checkpoint {path}") from exc
        for relative, expected in checksums.items():
            file = path / relative
            if not file.exists():
                raise CheckpointError(f"checkpoint file {file} is missing; the checkpoint {path} is unusable")
            if _sha256(file) != expected:
                raise CheckpointError(f"checkpoint file {file} is corrupted (checksum mismatch); delete {path} "
                                      "to resume from an earlier checkpoint")
        state: dict[str, Any] = json.loads((path / TRAINER_STATE_FILE).read_text())
        return state


#: per-step files a run appends to; a fresh start in a directory that holds them moves them aside
RUN_LOGS = ("metrics.jsonl", "ledger.jsonl", "recovery.jsonl", "rollouts.jsonl")


def archive_previous_logs(run_dir: str | Path) -> Path | None:
    """Move the per-step logs an earlier run left in ``run_dir`` to ``run_dir/previous/<n>/`` (nothing is deleted);
    return that folder, or None when there was nothing to move. Called when a run starts from step 0."""
    run_dir = Path(run_dir)
    found = [run_dir / name for name in RUN_LOGS if (run_dir / name).exists() and (run_dir / name).stat().st_size]
    if not found:
        return None
    previous = run_dir / "previous"
    previous.mkdir(exist_ok=True)
    target = previous / str(sum(1 for _ in previous.iterdir()))
    target.mkdir()
    for path in found:
        path.rename(target / path.name)
    return target
