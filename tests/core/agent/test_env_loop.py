"""Rollouts against an environment served over reset/step (hybridflow.agent.env_loop): the tool-calc task served as
an environment (ToolCalcEnv over the real EnvServer, WebSocket sessions) gives the same token sequences, masks,
log-probs, turn and tool counts and rewards as the built-in tool loop with the calculator; environments that raise,
hang, answer junk or are not there fail only their own episodes, within the timeout, counted in ``env/*``.

:class:`ToolCalcPolicyDouble` stands in for a trained policy (a random tiny model writes no calls): its turn is a
function of the conversation so far (the question, how many calls it made), so both loops see the same policy.
The chat format, the loops, the tools, the server, the client and the batch assembly are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from aiohttp import web

from hybridflow.agent import AgentLoop, ChatFormat, MultiTurnConfig, summarize_agent_metrics
from hybridflow.agent.env_loop import EnvEpisode, EnvLoop
from hybridflow.agent.env_rollout import build_env_batch, env_reset_kwargs
from hybridflow.agent.env_server import EnvServer
from hybridflow.agent.environment import EnvStep
from hybridflow.algorithms.helpers import decode_batch
from hybridflow.batch import Batch
from hybridflow.engines import SamplingParams, TokenCompletion
from hybridflow.tasks.tool_calc import tool_calc_reward, tool_call_text
from hybridflow.tasks.tool_calc_env import ToolCalcEnv
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer
from hybridflow.tools import build_tools

QUESTION = re.compile(r"(\d+)\*(\d+)")


class ToolCalcPolicyDouble:
    """Test double of a policy on the tool-calc task. By ``(a + b) % 6``: 0 calls the tool and copies the product,
    1 answers a wrong number at once, 2 calls and answers wrong, 3 calls twice (cut by max_turns), 4 writes a
    malformed call and then answers, 5 calls twice in one turn and copies."""

    capabilities = frozenset({"continue_from_tokens"})
    weights_version = 0

    def __init__(self, chat_format: ChatFormat) -> None:
        self.chat = chat_format
        self.prompts: list[tuple[int, ...]] = []
        self.call_end = chat_format.encode("</tool_call>")[-1]

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = ()) -> list[TokenCompletion]:
        return [self._turn(tuple(int(t) for t in prefix)) for prefix in prompts]

    def _turn(self, prefix: tuple[int, ...]) -> TokenCompletion:
        prompt = next((p for p in self.prompts if prefix[:len(p)] == p), None)
        if prompt is None:
            self.prompts.append(prefix)
            prompt = prefix
        turn = sum(1 for t in prefix[len(prompt):] if t == self.call_end)
        found = QUESTION.findall(self.chat.decode(list(prompt)))
        a, b = (int(x) for x in found[-1])
        kind, product = (a + b) % 6, a * b
        call = tool_call_text(f"{a}*{b}")
        script = {0: [call, f"It is {product}"], 1: ["1234"], 2: [call, f"{product + 1}"], 3: [call, call],
                  4: ['<tool_call>{"name": "calculator", "arguments": </tool_call>', "0"],
                  5: [call + call, f"{product}"]}[kind]
        text = script[min(turn, len(script) - 1)]
        ids = self.chat.encode(text)
        if not text.endswith("</tool_call>"):
            ids.append(self.chat.eos_token_id)
        log_probs = tuple(-0.01 * (k + 1) for k in range(len(ids)))
        return TokenCompletion(token_ids=tuple(ids), log_probs=log_probs, finish_reason="stop")


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(build_chat_tokenizer())


@pytest.fixture(scope="module")
def tool_calc_server() -> Iterator[EnvServer]:
    server = EnvServer(ToolCalcEnv)
    server.start()
    yield server
    server.stop()


QUESTIONS = [f"{a}*{b}" for a, b in ((12, 36), (13, 36), (14, 36), (15, 36), (16, 36), (17, 36), (21, 45),
                                     (22, 45), (23, 45), (24, 45), (25, 45), (26, 45))]


def _rows(chat: ChatFormat, questions: Sequence[str]) -> tuple[list[list[int]], Batch]:
    schemas = [dict(tool.description) for tool in build_tools(["calculator"]).values()]
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = [chat.render_prompt(m, schemas) for m in messages]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 0, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    answers = [str(int(q.split("*")[0]) * int(q.split("*")[1])) for q in questions]
    rows = Batch({"input_ids": ids, "attention_mask": mask},
                 {"raw_prompt": messages, "ground_truth": answers, "data_source": ["hybridflow/tool_calc"] * len(
                     prompts), "extra_info": [{"index": i} for i in range(len(prompts))],
                  "uid": [f"u{i}" for i in range(len(prompts))]}, {"iteration": 0})
    return prompts, rows


def test_tool_calc_served_as_an_environment_rolls_out_exactly_as_the_builtin_loop(
        chat: ChatFormat, tool_calc_server: EnvServer) -> None:
    config = MultiTurnConfig(max_turns=2, max_tokens=96)
    prompts, rows = _rows(chat, QUESTIONS)
    sampling = SamplingParams(max_new_tokens=48, seed=0)
    builtin = AgentLoop(ToolCalcPolicyDouble(chat), build_tools(["calculator"]), chat, config).run(prompts, sampling)
    loop = EnvLoop(ToolCalcPolicyDouble(chat), chat, config, base_url=tool_calc_server.base_url, timeout_s=10)
    episodes = loop.run_episodes(prompts, sampling, env_reset_kwargs(rows, seed=0))

    assert [episode.status for episode in episodes] == ["ok"] * len(QUESTIONS)
    builtin_text = decode_batch(chat.tokenizer, [[t for t, g in zip(c.response_ids, c.generated) if g]
                                                 for c in builtin])
    builtin_rewards = tool_calc_reward(responses=builtin_text, ground_truths=list(rows.non_tensors["ground_truth"]),
                                       data_sources=[""] * len(builtin))
    for conversation, episode, reward in zip(builtin, episodes, builtin_rewards):
        other = episode.conversation
        assert other.response_ids == conversation.response_ids
        assert other.generated == conversation.generated and other.log_probs == conversation.log_probs
        assert (other.turns, other.tool_calls) == (conversation.turns, conversation.tool_calls)
        assert other.tool_statuses == conversation.tool_statuses
        assert episode.reward == reward
    # every behaviour occurs: copied products score, wrong answers do not; at the 96-id budget the malformed call's
    # error turn is cut (truncated), and the two-call turns' answers are cut by the budget: "612" whole (scores),
    # "1170" after its first digit (does not), as in the built-in loop
    assert builtin_rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [e.truncated for e in episodes] == [False, False, False, True, True, False] * 2
    assert [c.finish for c in builtin][3:6] == ["max_turns", "max_tokens", "length"]
    assert {c.tool_calls for c in builtin} == {0, 1, 2} and any(c.tool_errors for c in builtin)
    assert tool_calc_server.sessions == 0  # every session closed

    batch = build_env_batch(rows, episodes, width=config.max_tokens, pad_token_id=0, policy_version=0)
    metrics = summarize_agent_metrics(batch)
    assert metrics["env/num_failed"] == 0 and metrics["env/truncated"] == 4
    assert metrics["env/reward/mean"] == pytest.approx(3 / 12)
    assert batch["agent_rewards"].tolist() == builtin_rewards


class FlakyEnv:
    """An environment whose episodes fail by their question's first operand: raise in step, hang, answer junk
    (reward not a number; observation without messages; not an object), or run normally."""

    def __init__(self) -> None:
        self.inner = ToolCalcEnv()
        self.mode = 0

    def reset(self, *, prompt: Sequence[Mapping[str, Any]], ground_truth: str) -> EnvStep:
        self.mode = int(str(prompt[-1]["content"]).split("*")[0]) % 6
        return self.inner.reset(prompt=prompt, ground_truth=ground_truth)

    async def step(self, action: Mapping[str, Any]) -> Any:
        if self.mode == 0:
            raise RuntimeError("the game engine crashed")
        if self.mode == 1:
            await asyncio.sleep(60)
        if self.mode == 2:
            return {"observation": {}, "reward": "lots", "done": True}
        if self.mode == 3:
            return EnvStep(observation={"text": "no messages"}, reward=0.0)
        if self.mode == 4:
            return ["not", "a", "step"]
        return await self.inner.step(action)

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode}


def test_failing_hanging_and_junk_environments_fail_only_their_episodes(chat: ChatFormat) -> None:
    server = EnvServer(FlakyEnv)
    url = server.start()
    try:
        questions = [f"{a}*36" for a in (12, 13, 14, 15, 16, 17, 18)]  # modes 0..5, then 0 again
        prompts, rows = _rows(chat, questions)
        loop = EnvLoop(ToolCalcPolicyDouble(chat), chat, MultiTurnConfig(max_turns=2, max_tokens=96),
                       base_url=url, timeout_s=1.5)
        started = time.monotonic()
        episodes = loop.run_episodes(prompts, SamplingParams(max_new_tokens=48), env_reset_kwargs(rows, seed=None))
        assert time.monotonic() - started < 15  # the hung step is abandoned at its timeout
        # the server checks what its environment returns (EXECUTION_ERROR); the loop checks the observation's turn
        assert [e.status for e in episodes] == ["error", "timeout", "error", "bad_response", "error", "ok", "error"]
        assert "the game engine crashed" in episodes[0].error and "EXECUTION_ERROR" in episodes[0].error
        assert "reward must be a finite number" in episodes[2].error
        assert "observation.messages" in episodes[3].error and "expected a step result" in episodes[4].error
        assert episodes[5].reward == 1.0 and episodes[5].done  # 17*36: mode 5, the real episode
        batch = build_env_batch(rows, episodes, width=96, pad_token_id=0, policy_version=0)
        assert batch["response_mask"][[0, 1, 2, 3, 4, 6]].sum() == 0  # failed episodes train on nothing
        assert batch["agent_rewards"].tolist() == [0, 0, 0, 0, 0, 1.0, 0]
        metrics = summarize_agent_metrics(batch)
        assert (metrics["env/num_failed"], metrics["env/error"], metrics["env/timeout"],
                metrics["env/bad_response"]) == (6, 4, 1, 1)
    finally:
        server.stop()

    # a server that is not there (stopped): every episode fails at reset, quickly
    loop = EnvLoop(ToolCalcPolicyDouble(chat), chat, MultiTurnConfig(max_turns=2, max_tokens=96),
                   base_url=url, timeout_s=2)
    episodes = loop.run_episodes(prompts[:2], SamplingParams(max_new_tokens=48), env_reset_kwargs(rows, seed=None)[:2])
    assert [e.status for e in episodes] == ["error", "error"] and "cannot open a session" in episodes[0].error


async def _junk_session(request: web.Request) -> web.WebSocketResponse:
    """A server that is not an environment: it answers reset with a step result and step with text that is no JSON,
    or with the wrong message type, by the episode's question."""
    socket = web.WebSocketResponse()
    await socket.prepare(request)
    question = ""
    async for message in socket:
        body = json.loads(message.data)
        if body["type"] == "reset":
            question = str(body["data"]["prompt"][-1]["content"])
            await socket.send_json({"type": "observation", "data": {"observation": {}, "reward": None,
                                                                    "done": False}})
        elif body["type"] == "step":
            await socket.send_str("<html>502</html>" if question.startswith("12") else '{"type": "state"}')
        else:
            break
    return socket


def test_junk_on_the_wire_is_a_bad_response(chat: ChatFormat) -> None:
    async def serve_and_run() -> list[EnvEpisode]:
        app = web.Application()
        app.router.add_get("/ws", _junk_session)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        prompts, rows = _rows(chat, ["12*36", "13*36"])
        loop = EnvLoop(ToolCalcPolicyDouble(chat), chat, MultiTurnConfig(max_turns=2, max_tokens=96),
                       base_url=f"http://127.0.0.1:{port}", timeout_s=5)
        try:
            return await asyncio.to_thread(loop.run_episodes, prompts, SamplingParams(max_new_tokens=48),
                                           env_reset_kwargs(rows, seed=None))
        finally:
            await runner.cleanup()

    episodes = asyncio.run(serve_and_run())
    assert [e.status for e in episodes] == ["bad_response", "bad_response"]
    assert "is not JSON" in episodes[0].error and "expected a 'observation' reply" in episodes[1].error


def test_reset_gets_the_row_and_its_env_kwargs(chat: ChatFormat) -> None:
    _, rows = _rows(chat, ["12*36"])
    rows.non_tensors["extra_info"] = [{"index": 0, "env_kwargs": {"level": 3}}]
    [kwargs] = env_reset_kwargs(rows, seed=5)
    assert kwargs == {"episode_id": "u0-0", "seed": 5, "prompt": [{"role": "user", "content": "12*36"}],
                      "ground_truth": "432", "data_source": "hybridflow/tool_calc",
                      "extra_info": {"index": 0, "env_kwargs": {"level": 3}}, "level": 3}
    json.dumps(kwargs)  # what the session sends
