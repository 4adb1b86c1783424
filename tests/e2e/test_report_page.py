"""Readable rollouts and the HTML report: a short GRPO run writes decoded samples to rollouts.jsonl, and
``hybridflow report`` renders them (with the plots, capacity and validation) into a page that headless Chromium
loads; the table is read back from the browser's DOM.

Chromium comes from Debian packages (``apt-get install chromium``; ``scripts/setup.sh --all`` installs it when it
can). Without it the browser check skips, and fails under ``HYBRIDFLOW_REQUIRE_ENGINES=1`` as a missing engine does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from hybridflow.report import main as report_main
from hybridflow.tasks.arithmetic import arithmetic_reward
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.rollouts import read_rollouts

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str:
    """The headless browser's path; skip without one (fail when HYBRIDFLOW_REQUIRE_ENGINES=1)."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path is not None:
            return path
    message = (f"no headless browser ({', '.join(BROWSERS)}) on PATH to load the report page. Install one: "
               "apt-get install -y chromium (bash scripts/setup.sh --all does when it runs as root on Debian)")
    if os.environ.get("HYBRIDFLOW_REQUIRE_ENGINES") == "1":
        pytest.fail(message)
    pytest.skip(message)


def dump_dom(browser: str, page: Path) -> str:
    """The DOM Chromium builds from ``page`` (after parsing and running it), serialised."""
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             f"--user-data-dir={page.parent / '.chromium'}", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and "<table" in result.stdout, result.stderr[-2000:]
    return result.stdout


class TableReader(HTMLParser):
    """Rows of the ``<table id=...>`` tables of a document: {table id: [[cell text, ...], ...]}."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self.images = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "table":
            self._table = attributes.get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "img" and (attributes.get("src") or "").startswith("data:image/png;base64,"):
            self.images += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._table is not None and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_rollouts_and_report_page_render_in_a_browser(tmp_path: Path, tiny_config) -> None:
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "trainer.total_steps=2", "trainer.checkpoint_every=0", "trainer.log_rollouts=3",
                         "trainer.val_every=2", "data.task.num_val_prompts=4")
    fit_and_close(Trainer(config, progress=False))

    samples = read_rollouts(run_dir)
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1]
    # three different prompt groups per step, each decoded: "a+b=" prompts, the sum as ground truth, and the logged
    # reward is the task's reward of the logged response (decoding and row order agree with the scored batch)
    for step in (0, 1):
        assert len({s["uid"] for s in samples if s["step"] == step}) == 3
    for sample in samples:
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", sample["prompt"]).groups())
        assert sample["ground_truth"] == str(a + b) and sample["data_source"] == "hybridflow/arithmetic"
        assert sample["reward"] == arithmetic_reward(responses=[sample["response"]], ground_truths=[
            sample["ground_truth"]], data_sources=[sample["data_source"]], extra=[{}])[0]
        assert 1 <= sample["length"] <= config.rollout.max_new_tokens and isinstance(sample["advantage"], float)

    # a sample with markup in it must show as text, not become markup
    tricky = {"step": 2, "data_source": "probe", "prompt": "<b>1</b> & 2 <script>x()</script>", "response": "a<br>b",
              "ground_truth": "3", "reward": 0.5, "advantage": -0.25, "length": 4}
    with (run_dir / "rollouts.jsonl").open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(tricky) + "\n")
    assert report_main([str(run_dir)]) == 0
    page = run_dir / "report.html"

    reader = TableReader()
    reader.feed(dump_dom(find_browser(), page))
    header, *rows = reader.tables["samples"]
    assert header == ["step", "data source", "prompt", "response", "ground truth", "reward", "advantage", "length"]
    assert len(rows) == 7
    for row, sample in zip(rows, [*samples, tricky]):
        assert row[0] == str(sample["step"]) and row[2] == sample["prompt"] and row[3] == sample["response"]
        assert float(row[5]) == pytest.approx(sample["reward"], abs=1e-4) and row[7] == str(sample["length"])
    capacity = dict(reader.tables["capacity"])
    assert capacity["samples per update"] == "64"  # 16 prompts × n=4
    assert float(capacity["policy updates per hour"]) > 0 and float(capacity["device-seconds per update"]) > 0
    validation = {row[0]: row for row in reader.tables["validation"][1:]}
    assert any(key.endswith("@1") for key in validation), validation
    assert reader.images >= 3  # reward, validation and time-by-node plots, inlined
