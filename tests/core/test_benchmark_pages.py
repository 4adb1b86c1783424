"""docs/benchmarks holds numbers from one source: a page says it was written by a bench (and then carries the header
bench/results_page.py writes: the writer, date, machine, command, a table), or says which numbers were recorded by
hand and the command that regenerates them. Also: what a bench's entry point writes passes that check, and the
check fails on a page whose header is broken."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "benchmarks"


@pytest.fixture(scope="module")
def results_page() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_page_is_bench_written_or_marked_as_copied_by_hand(results_page: ModuleType) -> None:
    pages = sorted(PAGES.rglob("*.md"))
    assert pages, f"no pages under {PAGES}"
    problems = [f"{page.relative_to(ROOT)}: {problem}" for page in pages
                for problem in results_page.check_page(page.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_a_bench_entry_point_writes_a_page_that_passes_the_check(results_page: ModuleType, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What every bench's ``__main__`` does (``results_page.run(main, title=...)``): --write is taken off the command
    line before the bench parses it, the RESULT rows become the table, the header names the bench and its command."""
    page = tmp_path / "reshard.md"
    bench = str(ROOT / "bench" / "reshard.py")
    monkeypatch.setattr(sys, "argv", [bench, "--quick", "--write", str(page)])
    monkeypatch.setattr(results_page, "ROWS", [])
    seen: list[list[str]] = []

    def main() -> int:
        seen.append(list(sys.argv))
        results_page.result({"case": "fsdp d=2 -> tg=1", "ratio": 1.0, "exact": True})
        results_page.result({"case": "fsdp d=2 -> tg=2", "ratio": 1.0, "exact": True})
        results_page.result({"summary": "all", "worst_ratio": 1.0})
        return 3

    assert results_page.run(main, title="Reshard bytes") == 3
    assert seen == [[bench, "--quick"]]
    text = page.read_text(encoding="utf-8")
    assert results_page.check_page(text) == []
    assert text.startswith("# Reshard bytes\n\nWritten by `bench/reshard.py` from its RESULT lines")
    assert f"python bench/reshard.py --quick --write {page}`" in text
    assert f"\n- tree: {results_page.tree()}\n" in text, "the page does not say which code ran"
    assert ("| case | ratio | exact |\n|---|---|---|\n| fsdp d=2 -> tg=1 | 1 | true |\n"
            "| fsdp d=2 -> tg=2 | 1 | true |") in text
    assert "| summary | worst_ratio |\n|---|---|\n| all | 1 |" in text


def test_no_rows_or_no_write_leave_the_page_alone(results_page: ModuleType, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "p.md"
    monkeypatch.setattr(results_page, "ROWS", [])
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "reshard.py"), "--write", str(page)])
    assert results_page.run(lambda: 0, title="t") == 0  # a child process that reports nothing
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "reshard.py"), "--no-write"])
    assert results_page.run(lambda: results_page.result({"a": 1}), title="t") == 0
    assert not page.exists()


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda text: text.replace("- date: 2026-12-07 03:30 UTC\n", ""), "no '- date: YYYY-MM-DD HH:MM UTC' line"),
    (lambda text: text.replace("- date: 2026-12-07 03:30 UTC", "- date: yesterday"), "no '- date:"),
    (lambda text: text.replace("- machine: AMD EPYC, 2 CPUs\n", ""), "no '- machine: ...' line"),
    (lambda text: text.replace("python bench/reshard.py --quick", "python bench/other.py"), "does not run"),
    (lambda text: text.replace("bench/reshard.py", "bench/gone.py"), "which does not exist"),
    (lambda text: text.split("| case")[0], "no markdown table"),
    (lambda text: text.replace("Written by `bench/reshard.py`", "Made by `bench/reshard.py`"),
     "neither written by a script"),
])
def test_the_check_fails_on_a_broken_header(results_page: ModuleType, edit: Callable[[str], str],
                                            expected: str) -> None:
    text = results_page.render(script="bench/reshard.py", title="Reshard bytes", rows=[{"case": "a", "ratio": 1.0}],
                               command="python bench/reshard.py --quick", date="2026-12-07 03:30 UTC",
                               machine_line="AMD EPYC, 2 CPUs")
    assert results_page.check_page(text) == []
    problems = results_page.check_page(edit(text))
    assert any(expected in problem for problem in problems), problems


def test_hand_recorded_numbers_must_name_a_command_that_exists(results_page: ModuleType) -> None:
    good = ("# x\n\nThe table below was recorded by hand on 2026-12-03, to be regenerated by "
            "`python bench/e2e_sizes.py`.\n")
    assert results_page.check_page(good) == []
    assert "does not exist" in results_page.check_page(good.replace("e2e_sizes", "e2e_gone"))[0]
    assert "name no bench" in results_page.check_page(good.replace("python bench/e2e_sizes.py", "make it"))[0]


def test_a_bench_help_names_the_page_options(results_page: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "reshard.py"), "--help"])

    def main() -> int:
        raise SystemExit(0)  # what argparse does after printing the bench's own help

    with pytest.raises(SystemExit):
        results_page.run(main, title="t")
    assert "--write PATH (default: docs/benchmarks/reshard.md), --no-write" in capsys.readouterr().out
