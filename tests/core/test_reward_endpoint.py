"""reward.endpoint: the rule reward from an HTTP service (a local http.server the test starts in a thread)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from hybridflow.config import load_config
from hybridflow.errors import ConfigError, RewardError
from hybridflow.rewards import score_responses
from hybridflow.rewards_remote import RewardEndpoint, build_reward_function

REQUESTS: list[dict[str, Any]] = []


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        REQUESTS.append(body)
        if self.path == "/slow":
            time.sleep(3)  # past the client's timeout: it has gone, nothing to answer
        elif self.path == "/fail":
            self._send(500, {"error": "boom"})
        elif self.path == "/short":
            self._send(200, {"scores": [1.0]})
        elif self.path == "/nokey":
            self._send(200, {"rewards": [1.0] * len(body["responses"])})
        else:
            scores = [float(r == t) + (e or {}).get("bonus", 0) for r, t, e in
                      zip(body["responses"], body["ground_truths"], body["extra_infos"])]
            self._send(200, {"scores": scores, "length": [len(r) for r in body["responses"]]})

    def _send(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    REQUESTS.clear()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_endpoint_scores_a_batch(server: str) -> None:
    function = build_reward_function(None, endpoint=f"{server}/score", timeout_s=10)
    assert isinstance(function, RewardEndpoint)
    result = score_responses(function, responses=["2", "3", "44"], ground_truths=["2", "4", "44"],
                             data_sources=["a", "b", "c"], extra=[{"bonus": 0.5}, None, {}])
    assert result.scores == [1.5, 0.0, 1.0]
    assert result.metrics == {"reward/extra/length": pytest.approx(4 / 3)}
    assert REQUESTS == [{"data_sources": ["a", "b", "c"], "responses": ["2", "3", "44"],
                         "ground_truths": ["2", "4", "44"], "extra_infos": [{"bonus": 0.5}, None, {}]}]


@pytest.mark.parametrize(("path", "message"), [
    ("/fail", r"endpoint .*/fail \(reward.endpoint\) answered HTTP 500"),
    ("/short", r"returned 1 scores for 2 responses"),
    ("/nokey", r"answered \['rewards'\]; expected a JSON object \{\"scores\""),
])
def test_endpoint_bad_answers_are_clear(server: str, path: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        score_responses(RewardEndpoint(server + path, timeout_s=10), responses=["a", "b"], ground_truths=["a", "b"],
                        data_sources=["s", "s"])


def test_endpoint_timeout_and_unreachable(server: str) -> None:
    with pytest.raises(RewardError, match=r"gave no answer within 0.5 s \(reward.timeout_s\) for 1 responses"):
        score_responses(RewardEndpoint(f"{server}/slow", timeout_s=0.5), responses=["a"], ground_truths=["a"],
                        data_sources=["s"])
    port = int(server.rpartition(":")[2])
    with pytest.raises(RewardError, match="could not be reached"):
        score_responses(RewardEndpoint(f"http://127.0.0.1:{port + 1 if port < 65535 else 1}/x", timeout_s=2),
                        responses=["a"], ground_truths=["a"], data_sources=["s"])


def test_endpoint_config_checks() -> None:
    config = load_config(None, ["reward.function=null", "reward.endpoint=http://127.0.0.1:1/score",
                                "reward.timeout_s=7"])
    assert config.reward.endpoint == "http://127.0.0.1:1/score"
    with pytest.raises(ConfigError, match="set function: null"):
        load_config(None, ["reward.function=arithmetic", "reward.endpoint=http://127.0.0.1:1/score"])
    with pytest.raises(ConfigError, match="http\\(s\\) URL"):
        load_config(None, ["reward.function=null", "reward.endpoint=localhost:1"])
