"""Children started with torch and transformers imported (hybridflow.controller.preloaded) look like spawned ones."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

# nothing heavy imported at module level: a child unpickling _report imports this module, so what it finds in
# sys.modules at _report's entry is what its start gave it

def _report(path: str) -> None:
    imported_at_entry = {name: name in sys.modules for name in ("torch", "transformers.modeling_utils", "tensordict")}
    Path(path).write_text(json.dumps({
        "imported_at_entry": imported_at_entry, "cpu_s_at_entry": time.process_time(),
        "marker": os.environ.get("HF_TEST_PRELOADED_MARKER"), "gone": os.environ.get("HF_TEST_PRELOADED_GONE"),
        "cwd": os.getcwd(), "sys_path": sys.path, "pid": os.getpid(), "parent": os.getppid(),
    }))


def _run(tmp_path: Path, name: str) -> dict[str, object]:
    from hybridflow.controller.preloaded import preloaded_process

    out = tmp_path / f"{name}.json"
    process = preloaded_process(_report, (str(out),))
    process.start()
    process.join(120)
    assert process.exitcode == 0, process.exitcode
    report: dict[str, object] = json.loads(out.read_text())
    return report


def test_a_child_starts_imported_in_the_callers_current_environment(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDFLOW_FORKSERVER", raising=False)
    monkeypatch.setenv("HF_TEST_PRELOADED_GONE", "set while the forkserver may start")
    first = _run(tmp_path, "first")  # starts the forkserver if no earlier test did
    # the environment, sys.path and working directory of the caller at each child's start, not the forkserver's
    monkeypatch.setenv("HF_TEST_PRELOADED_MARKER", "set after the forkserver started")
    monkeypatch.delenv("HF_TEST_PRELOADED_GONE")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "on_the_path"))
    second = _run(tmp_path, "second")
    assert first["gone"] == "set while the forkserver may start"
    assert second["marker"] == "set after the forkserver started" and second["gone"] is None
    assert second["cwd"] == str(tmp_path) and str(tmp_path / "on_the_path") in second["sys_path"]
    # what the child did not pay for: the heavy imports were there when its target began, and it has used
    # a fraction of the ~3+ CPU-s that importing torch alone costs a fresh interpreter here
    for report in (first, second):
        assert report["imported_at_entry"] == {"torch": True, "transformers.modeling_utils": True,
                                               "tensordict": True}, report
    assert float(str(second["cpu_s_at_entry"])) < 1.0, second
    # both forked from the same forkserver (not from this process, not spawned)
    assert first["parent"] == second["parent"] != os.getpid()


def test_turned_off_it_spawns_a_fresh_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.controller.preloaded import preloaded_context

    monkeypatch.setenv("HYBRIDFLOW_FORKSERVER", "0")
    assert preloaded_context().get_start_method() == "spawn"
    report = _run(tmp_path, "spawned")
    assert report["parent"] == os.getpid()
    # a fresh interpreter pays its imports (torch among them: the harness module imports hybridflow.controller)
    # before the target starts: the cost the forkserver's children skip
    assert float(str(report["cpu_s_at_entry"])) > 2.0, report
