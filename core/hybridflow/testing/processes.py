"""Finding test processes by a tag in their command line (stability: developer, for tests).

A test that starts processes which must not outlive something (a tool call, a worker) gives them a tag unique to
that test and asks the host's /proc which pids still carry it; a tag shared with other tests' processes (a scratch
dir prefix, a program name) would make the answer depend on what else runs on the machine.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["processes_tagged"]


def processes_tagged(tag: str) -> list[int]:
    """Host pids whose command line contains ``tag`` (processes gone while being read are skipped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
