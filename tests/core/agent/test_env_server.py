"""The environment server speaks OpenEnv's protocol both ways, tested with OpenEnv's own code (``openenv-core``
0.3.0, from PyPI, in the test extra): its ``GenericEnvClient`` runs tool-calc episodes against our
:class:`~hybridflow.agent.env_server.EnvServer`, and our rollout loop runs the same episodes against OpenEnv's own
FastAPI server (``create_fastapi_app`` over an OpenEnv ``Environment`` wrapping ToolCalcEnv) with the same results.
The stateless HTTP routes and the token are checked with a plain HTTP client.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from hybridflow.agent import ChatFormat, MultiTurnConfig
from hybridflow.agent.env_loop import EnvLoop
from hybridflow.agent.env_rollout import env_reset_kwargs
from hybridflow.agent.env_server import EnvServer
from hybridflow.engines import SamplingParams
from hybridflow.tasks.tool_calc import tool_call_text
from hybridflow.tasks.tool_calc_env import ToolCalcEnv
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer

# the policy double and rows of the loop's tests (pytest puts this folder on sys.path: no __init__.py here)
from test_env_loop import QUESTIONS, ToolCalcPolicyDouble, _rows  # isort: skip


@pytest.fixture(scope="module")
def server() -> Iterator[EnvServer]:
    served = EnvServer(ToolCalcEnv)
    served.start()
    yield served
    served.stop()


def test_openenv_client_runs_episodes_on_our_server(server: EnvServer) -> None:
    from openenv.core import GenericEnvClient

    with GenericEnvClient(base_url=server.base_url).sync() as env:
        first = env.reset(question="47*86", seed=3, not_a_reset_argument=1)  # unknown kwargs are dropped, as OpenEnv
        assert first.observation == {"messages": [{"role": "user", "content": "47*86"}]} and not first.done
        called = env.step({"message": tool_call_text("47*86")})
        assert called.observation["messages"] == [{"role": "tool", "content": "4042"}]
        assert (called.reward, called.done) == (0.0, False)
        assert env.state()["step_count"] == 1
        answered = env.step({"message": "So it is 4042"})
        assert (answered.reward, answered.done) == (1.0, True)
        again = env.reset(question="12*12")  # a new episode in the same session
        assert env.step({"message": "140"}).reward == 0.0 and again.observation["messages"][0]["content"] == "12*12"
        with pytest.raises(RuntimeError, match="EXECUTION_ERROR"):  # the environment's own error, reported
            env.step({"not_message": 1})
    assert server.sessions == 0


def _get(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_stateless_http_routes_and_the_token(server: EnvServer) -> None:
    url = server.base_url
    assert _get(f"{url}/health") == (200, {"status": "healthy"})
    status, body = _get(f"{url}/reset", {"seed": 4})
    assert status == 200 and set(body) == {"observation", "reward", "done"} and body["done"] is False
    # OpenEnv's HTTP step runs on a fresh instance (sessions are /ws): tool-calc refuses a step before reset
    status, body = _get(f"{url}/step", {"action": {"message": "1"}})
    assert status == 500 and "step before reset" in body
    assert _get(f"{url}/step", {"nothing": 1})[0] == 422
    assert _get(f"{url}/state")[1]["step_count"] == 0
    root = url.rsplit("/", 1)[0]
    assert _get(f"{root}/health")[0] == 404 and _get(f"{root}/wrong-token/reset", {})[0] == 404


def _openenv_tool_calc_app() -> Any:
    """OpenEnv's own server over an OpenEnv Environment that wraps ToolCalcEnv (what a user of OpenEnv writes)."""
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
    from pydantic import Field

    class MessageAction(Action):
        message: str

    class ChatObservation(Observation):
        messages: list[dict[str, str]] = Field(default_factory=list)
        tool_statuses: list[str] = Field(default_factory=list)

    class OpenEnvToolCalc(Environment[MessageAction, ChatObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True  # each session's instance holds its own episode

        def __init__(self) -> None:
            super().__init__()
            self.inner = ToolCalcEnv()

        def reset(self, seed: int | None = None, episode_id: str | None = None, prompt: Any = None,
                  ground_truth: Any = None, **kwargs: Any) -> ChatObservation:
            result = self.inner.reset(seed=seed, episode_id=episode_id, prompt=prompt, ground_truth=ground_truth)
            return ChatObservation(messages=result.observation["messages"])

        def step(self, action: MessageAction, timeout_s: float | None = None, **kwargs: Any) -> ChatObservation:
            result = asyncio.run(self.inner.step({"message": action.message}))
            return ChatObservation(messages=result.observation["messages"], done=result.done, reward=result.reward,
                                   tool_statuses=result.observation.get("tool_statuses", []))

        @property
        def state(self) -> State:
            return State(step_count=self.inner.steps)

    return create_fastapi_app(OpenEnvToolCalc, MessageAction, ChatObservation, max_concurrent_envs=64)


def test_our_rollout_loop_runs_on_openenvs_own_server(server: EnvServer) -> None:
    import uvicorn

    config = uvicorn.Config(_openenv_tool_calc_app(), host="127.0.0.1", port=0, log_level="warning",
                            ws="websockets-sansio")
    openenv_server = uvicorn.Server(config)
    thread = threading.Thread(target=openenv_server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not openenv_server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = openenv_server.servers[0].sockets[0].getsockname()[1]
        chat = ChatFormat(build_chat_tokenizer())
        prompts, rows = _rows(chat, QUESTIONS)
        config_turns = MultiTurnConfig(max_turns=2, max_tokens=96)
        results = []
        for url in (f"http://127.0.0.1:{port}", server.base_url):
            loop = EnvLoop(ToolCalcPolicyDouble(chat), chat, config_turns, base_url=url, timeout_s=10)
            results.append(loop.run_episodes(prompts, SamplingParams(max_new_tokens=48), env_reset_kwargs(
                rows, seed=0)))
    finally:
        openenv_server.should_exit = True
        thread.join(timeout=10)
    on_openenv, on_ours = results
    assert [e.status for e in on_openenv] == ["ok"] * len(QUESTIONS)
    assert [e.reward for e in on_openenv] == [e.reward for e in on_ours] and sum(e.reward for e in on_ours) == 3
    assert [e.conversation.response_ids for e in on_openenv] == [e.conversation.response_ids for e in on_ours]
    assert [e.truncated for e in on_openenv] == [e.truncated for e in on_ours]


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_the_command_serves_a_class_until_interrupted(stop: str) -> None:
    import signal
    import subprocess
    import sys

    # started with SIGINT ignored, as a shell's background job or a pytest-xdist worker's child is (a CI run found
    # the command deaf to SIGINT there: Python installs no KeyboardInterrupt handler over an inherited SIG_IGN)
    process = subprocess.Popen([sys.executable, "-m", "hybridflow.agent.env_server",
                                "hybridflow.tasks.tool_calc_env:ToolCalcEnv", "--options", '{"tool_timeout_s": 2}'],
                               stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and len(url.rsplit("/", 1)[1]) >= 24  # loopback, a token
        assert _get(f"{url}/health") == (200, {"status": "healthy"})
        assert _get(f"{url}/reset", {"question": "3*4"})[1]["observation"]["messages"][0]["content"] == "3*4"
    finally:
        process.send_signal(getattr(signal, stop))
        assert process.wait(timeout=30) == 0
