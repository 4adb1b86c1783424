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
