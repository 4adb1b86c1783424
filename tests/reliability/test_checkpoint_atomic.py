"""Checkpoints are atomic and checksummed: a process killed mid-write leaves the previous one intact and loadable,
and a corrupted one is refused with a message naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow.errors import CheckpointError
from hybridflow.trainer.checkpoint import CHECKSUM_FILE, CheckpointManager

WRITER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from hybridflow.trainer.checkpoint import CheckpointManager

    run_dir, where = sys.argv[1], sys.argv[2]
    manager = CheckpointManager(run_dir, keep=3)

    def write_workers(path, step):
        (Path(path) / "actor").mkdir()
        (Path(path) / "actor" / "weights.bin").write_bytes(bytes([step]) * 4096)
        if step == 2 and where == "workers":
            with open(Path(path) / "actor" / "optimizer.bin", "wb") as handle:
                handle.write(b"half")
                handle.flush()
                os._exit(9)  # killed in the middle of writing a file

    def before_publish(tmp):
        if where == "publish":
            os._exit(9)  # killed after every file is written, before the rename

    manager.save(1, lambda p: write_workers(p, 1), {"loader": {"epoch": 0, "position": 16}})
    manager.save(2, lambda p: write_workers(p, 2), {"loader": {"epoch": 0, "position": 32}},
                 before_publish=before_publish)
    print("not killed")
""")


@pytest.mark.parametrize("where", ["workers", "publish"])
def test_kill_mid_write_leaves_previous_checkpoint(tmp_path: Path, where: str) -> None:
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), where], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 9, done.stderr
    manager = CheckpointManager(tmp_path, keep=3)
    assert manager.steps() == [1]
    assert list(manager.root.glob(".tmp-step-2-*")), "the interrupted write should be left as a .tmp directory"
    state = manager.verify(manager.latest())
    assert state["step"] == 1 and state["loader"] == {"epoch": 0, "position": 16}
    assert (manager.latest() / "actor" / "weights.bin").read_bytes() == bytes([1]) * 4096
    # the next save publishes and sweeps the leftover
    manager.save(2, lambda p: (Path(p) / "w.bin").write_bytes(b"ok"), {"loader": {}})
    assert manager.steps() == [1, 2] and not list(manager.root.glob(".tmp-*"))


def _saved(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    manager = CheckpointManager(tmp_path)

    def write(path: str) -> None:
        (Path(path) / "actor").mkdir()
        (Path(path) / "actor" / "model.distcp").write_bytes(bytes(range(256)) * 16)

    return manager, manager.save(3, write, {"loader": {"epoch": 1, "position": 0}})


def test_flipped_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    manager, path = _saved(tmp_path)
    target = path / "actor" / "model.distcp"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        manager.verify(path)
    assert str(target) in str(info.value) and "checksum mismatch" in str(info.value)


def test_missing_file_and_corrupted_index_are_refused(tmp_path: Path) -> None:
    manager, path = _saved(tmp_path)
    (path / "actor" / "model.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"model\.distcp is missing"):
        manager.verify(path)
    (path / CHECKSUM_FILE).write_text("{not json")
    with pytest.raises(CheckpointError) as info:
        manager.verify(path)
    assert CHECKSUM_FILE in str(info.value)
    (path / CHECKSUM_FILE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        manager.verify(path)
    assert manager.latest() is None  # a checkpoint without its index is never offered for resume


def test_checksums_cover_every_file(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    listed = set(json.loads((path / CHECKSUM_FILE).read_text()))
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE}
    assert listed == on_disk


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_a_fresh_start_moves_an_earlier_runs_logs_aside(tmp_path: Path, resume: str) -> None:
    """Starting at step 0 in a directory with an earlier run's metrics/ledger (trainer.resume=never, or auto with no
    checkpoint) moves those rows to previous/<n>/ instead of appending the new run's rows after them."""
    from hybridflow.config import load_config
    from hybridflow.trainer import Trainer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old_rows = "".join(json.dumps({"step": step, "reward/mean": 0.5}) + "\n" for step in range(30))
    (run_dir / "metrics.jsonl").write_text(old_rows)
    (run_dir / "ledger.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    config = load_config(None, [f"trainer.run_dir={run_dir}", f"trainer.resume={resume}", "trainer.tensorboard=false",
                                "data.task.num_prompts=16"])
    trainer = Trainer(config, progress=False)
    try:
        trainer._maybe_resume()
    finally:
        trainer.close()
    assert trainer.step == 0
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "ledger.jsonl").exists()
    assert (run_dir / "previous" / "0" / "metrics.jsonl").read_text() == old_rows  # nothing lost
    assert (run_dir / "previous" / "0" / "ledger.jsonl").exists()
    (run_dir / "metrics.jsonl").write_text(old_rows)
    Trainer(config, progress=False)._maybe_resume()
    assert (run_dir / "previous" / "1" / "metrics.jsonl").read_text() == old_rows
