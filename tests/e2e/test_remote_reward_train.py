"""The trainer scoring away from its driver thread: GRPO whose reward is served by a real HTTP server on loopback
(``reward.endpoint``), and GRPO whose reward pool (``reward.num_workers``) meets a function that raises on some
samples and hangs on one: the step completes in bounded time, those samples score 0 and ``reward/num_failed``
counts them."""

from __future__ import annotations

import json
import logging
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from hybridflow.rewards_remote import FAILED_SCORE
from hybridflow.trainer import Trainer
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.rollouts import read_rollouts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a hung step fails here, not at the suite's 600 s

ROWS = 16 * 4  # the example's data.batch_size prompts × rollout.n samples: trainer.log_rollouts keeps them all


def _answer(response: str, ground_truth: str) -> float:
    """The server's score: varied over the batch, so the mean the trainer logs tells rows apart."""
    return float(response.strip() == ground_truth) + 0.125 * (len(response) % 5)


class _ScoreServer(ThreadingHTTPServer):
    """Answers ``reward.endpoint``'s POSTs and keeps each request and the scores it answered."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)  # the kernel picks the port; the server holds it throughout
        self.exchanges: list[tuple[dict[str, Any], list[float]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    server: _ScoreServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        scores = [_answer(r, str(t)) for r, t in zip(body["responses"], body["ground_truths"], strict=True)]
        self.server.exchanges.append((body, scores))
        payload = json.dumps({"scores": scores, "length": [len(r) for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture()
def score_server() -> Iterator[_ScoreServer]:
    server = _ScoreServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _by_step(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    rows: dict[int, list[dict[str, Any]]] = {}
    for sample in read_rollouts(run_dir):
        rows.setdefault(sample["step"], []).append(sample)
    return {step: sorted(samples, key=lambda sample: sample["row"]) for step, samples in rows.items()}


def test_grpo_scored_by_an_http_endpoint_on_loopback(tmp_path: Path, tiny_config: Any,
                                                    score_server: _ScoreServer) -> None:
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "reward.function=null", f"reward.endpoint={score_server.url}", "reward.timeout_s=60",
                         "trainer.total_steps=2", "trainer.checkpoint_every=0", f"trainer.log_rollouts={ROWS}")
    history = fit_and_close(Trainer(config, progress=False))
    assert len(history) == 2
    # one POST per step, holding exactly the step's responses in row order, with their ground truths
    assert len(score_server.exchanges) == 2, [len(body["responses"]) for body, _ in score_server.exchanges]
    rollouts = _by_step(run_dir)
    assert sorted(rollouts) == [0, 1], sorted(rollouts)
    for (body, answered), metrics, samples in zip(score_server.exchanges, history, (rollouts[0], rollouts[1]),
                                                  strict=True):
        assert [sample["row"] for sample in samples] == list(range(ROWS))
        assert body["responses"] == [sample["response"] for sample in samples]
        assert body["ground_truths"] == [sample["ground_truth"] for sample in samples]
        assert body["data_sources"] == [sample["data_source"] for sample in samples]
        assert len(body["extra_infos"]) == ROWS
        # what the server answered is what the trainer trained on and logged
        assert [sample["reward"] for sample in samples] == pytest.approx(answered)
        assert metrics["reward/mean"] == pytest.approx(sum(answered) / ROWS, rel=1e-6)
        assert metrics["reward/max"] == pytest.approx(max(answered), rel=1e-6)
        assert metrics["reward/extra/length"] == pytest.approx(sum(len(r) for r in body["responses"]) / ROWS)
    assert len({json.dumps(body["responses"]) for body, _ in score_server.exchanges}) == 2  # two steps' samples


FLAKY_REWARD = '''
import os
import time

HUNG = {hung!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 3 == 0:
        raise ValueError(f"cannot score ground truth {{ground_truth}}")
    try:  # the first sample that would score hangs, once in the run: its worker records itself, then sleeps
        fd = os.open(HUNG, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return 1.0 + len(solution_str) / 100
    os.write(fd, f"{{os.getpid()}}\\n{{solution_str}}".encode())
    os.close(fd)
    time.sleep(600)
    return 1.0
'''


def test_pool_turns_raising_and_hanging_samples_into_failed_samples(tmp_path: Path, tiny_config: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    hung = tmp_path / "hung.txt"
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(textwrap.dedent(FLAKY_REWARD.format(hung=str(hung))))
    run_dir = tmp_path / "run"
    timeout_s = 2
    config = tiny_config(run_dir, f"reward.function={reward_file}:compute_score", "reward.num_workers=2",
                         f"reward.timeout_s={timeout_s}", "trainer.total_steps=1", "trainer.checkpoint_every=0",
                         f"trainer.log_rollouts={ROWS}")
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards_remote"):
        history = fit_and_close(Trainer(config, progress=False))
    assert len(history) == 1
    metrics = history[0]
    samples = next(iter(_by_step(run_dir).values()))
    assert [sample["row"] for sample in samples] == list(range(ROWS))
    raising = [s for s in samples if int(s["ground_truth"]) % 3 == 0]
    others = [s for s in samples if int(s["ground_truth"]) % 3 != 0]
    assert raising and len(others) > 1, "expected the first batch to hold sums divisible by 3 and others"
    # the hanging call really ran past reward.timeout_s, and its worker was killed
    pid, hung_response = hung.read_text().split("\n", 1)
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    assert metrics["timing_s/step"] >= timeout_s
    # the raising samples and the hung one scored FAILED_SCORE; every other sample its own score
    assert all(s["reward"] == FAILED_SCORE for s in raising)
    hung_rows = [s for s in others if s["reward"] == FAILED_SCORE]
    assert len(hung_rows) == 1 and hung_rows[0]["response"] == hung_response, hung_rows
    scored = [s for s in others if s is not hung_rows[0]]
    assert [s["reward"] for s in scored] == pytest.approx([1.0 + len(s["response"]) / 100 for s in scored])
    # counted, and logged naming the errors
    assert metrics["reward/num_failed"] == len(raising) + 1
    assert metrics["reward/failed_ratio"] == pytest.approx((len(raising) + 1) / ROWS)
    assert metrics["reward/mean"] == pytest.approx(sum(s["reward"] for s in samples) / ROWS, rel=1e-6)
    assert f"timed out: no result after {timeout_s} s (reward.timeout_s)" in caplog.text
    assert f"{len(raising) + 1} of {ROWS} samples failed and were scored 0 (reward/num_failed)" in caplog.text
    assert "raised ValueError: cannot score ground truth" in caplog.text
