"""verl's multi-turn data conventions: ``extra_info.tools_kwargs`` reaches a stateful tool's create/call per
sample, and the ``agent_name`` column chooses the loop (``single_turn_agent`` runs no tools).

:class:`ScriptedPolicyDouble` stands in for a trained policy (a random tiny model does not write well-formed calls):
it continues every prefix with a scripted tool call on its first turn and a fixed answer after. The tools, the
chat format, the loop and the batch assembly are the real ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from hybridflow.agent import AgentLoop, ChatFormat, MultiTurnConfig
from hybridflow.agent.worker import AgentRollout
from hybridflow.batch import Batch
from hybridflow.data import PromptDataset
from hybridflow.engines import SamplingParams, TokenCompletion
from hybridflow.errors import ConfigError
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer
from hybridflow.tools import StatefulTool, ToolResult, tool_schema

CALL = '<tool_call>{"name": "vault", "arguments": {"key": "a"}}</tool_call>'


class ScriptedPolicyDouble:
    """Test double of a policy: first turn a call of ``vault``, then ``done`` and EOS."""

    capabilities = frozenset({"continue_from_tokens"})
    weights_version = 0

    def __init__(self, chat_format: ChatFormat) -> None:
        self.chat = chat_format
        self.prompts: set[tuple[int, ...]] = set()

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = ()) -> list[TokenCompletion]:
        out = []
        for prefix in prompts:
            first = tuple(prefix) not in self.prompts and not any(tuple(prefix[:len(p)]) == p for p in self.prompts)
            if first:
                self.prompts.add(tuple(prefix))
            ids = tuple(self.chat.encode(CALL)) if first else (*self.chat.encode("done"), self.chat.eos_token_id)
            out.append(TokenCompletion(token_ids=ids, log_probs=(-0.5,) * len(ids), finish_reason="stop"))
        return out


class VaultTool:
    """A stateful tool (verl's BaseTool shape): each conversation opens its own vault from create_kwargs."""

    name = "vault"
    description = tool_schema("vault", "Read a secret.", {"key": {"type": "string"}}, ["key"])

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []
        self.released: list[dict[str, Any]] = []

    async def create(self, **create_kwargs: Any) -> dict[str, Any]:
        instance = {"secret": create_kwargs["secret"], "calls": 0}
        self.created.append(instance)
        return instance

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float, instance: Any = None,
                   **execute_kwargs: Any) -> ToolResult:
        instance["calls"] += 1
        return ToolResult(text=f"{instance['secret']}{execute_kwargs.get('suffix', '')}")

    async def release(self, instance: Any) -> None:
        self.released.append(instance)


@pytest.fixture
def chat() -> ChatFormat:
    return ChatFormat(build_chat_tokenizer())


def _prompts(chat: ChatFormat, count: int) -> list[list[int]]:
    return [chat.render_prompt([{"role": "user", "content": f"secret {i}?"}]) for i in range(count)]


def test_tools_kwargs_reach_create_and_call_per_sample(chat: ChatFormat) -> None:
    vault = VaultTool()
    assert isinstance(vault, StatefulTool)
    loop = AgentLoop(ScriptedPolicyDouble(chat), {"vault": vault}, chat, MultiTurnConfig(max_turns=3))
    kwargs = [{"vault": {"create_kwargs": {"secret": f"S{i}"}, "execute_kwargs": {"suffix": "!" * i}}}
              for i in range(3)]
    conversations = loop.run(_prompts(chat, 3), SamplingParams(max_new_tokens=64), tools_kwargs=kwargs)
    for i, conversation in enumerate(conversations):
        tool_text = chat.decode([t for t, g in zip(conversation.response_ids, conversation.generated) if not g])
        assert f"S{i}{'!' * i}" in tool_text and conversation.tool_statuses == {"ok": 1}
    assert sorted(v["secret"] for v in vault.created) == ["S0", "S1", "S2"]  # one instance per conversation
    assert sorted(v["secret"] for v in vault.released) == ["S0", "S1", "S2"] and all(
        v["calls"] == 1 for v in vault.created)
    with pytest.raises(ConfigError, match="create_kwargs"):
        loop.run(_prompts(chat, 1), SamplingParams(), tools_kwargs=[{"vault": {"secret": "x"}}])


def test_a_failing_create_is_tool_output(chat: ChatFormat) -> None:
    vault = VaultTool()
    loop = AgentLoop(ScriptedPolicyDouble(chat), {"vault": vault}, chat, MultiTurnConfig(max_turns=3))
    conversation, = loop.run(_prompts(chat, 1), SamplingParams(max_new_tokens=64), tools_kwargs=[None])
    assert conversation.tool_statuses == {"error": 1}  # no create_kwargs: create raised KeyError
    assert "could not start" in chat.decode(conversation.response_ids)


def test_agent_name_column_chooses_the_loop(chat: ChatFormat) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "d", "reward_model": {"ground_truth": 1},
             "agent_name": name, "extra_info": {"tools_kwargs": {"vault": {"create_kwargs": {"secret": "s"}}}}}
            for i, name in enumerate(["single_turn_agent", "tool_agent"])]
    dataset = PromptDataset.from_rows(rows, chat.tokenizer, max_prompt_length=64)
    prompts = dataset.batch([0, 1], uids=["a", "b"])
    assert [extra["agent_name"] for extra in prompts["extra_info"]] == ["single_turn_agent", "tool_agent"]

    rollout = AgentRollout.__new__(AgentRollout)  # its engine/tokenizer loading needs a model dir: set its parts
    rollout.config = MultiTurnConfig(max_turns=3, max_tokens=128)
    rollout.loop = AgentLoop(ScriptedPolicyDouble(chat), {"vault": VaultTool()}, chat, rollout.config)
    rollout.pad_token_id = chat.tokenizer.pad_token_id
    rollout.engine = rollout.loop.engine  # type: ignore[assignment]
    out = rollout.generate(Batch(prompts.tensors, prompts.non_tensors), SamplingParams(n=1, max_new_tokens=64))
    assert out["num_turns"].tolist() == [1.0, 2.0] and out["tool_call_counts"].tolist() == [0.0, 1.0]
    assert torch.equal(out["response_mask"][0].nonzero().flatten(), torch.arange(len(chat.encode(CALL))))
    with pytest.raises(ConfigError, match="unknown agent_name 'react'"):
        rollout.loop.run(_prompts(chat, 1), SamplingParams(), agent_names=["react"])


class RetryUser:
    """An interaction (a real one, not a double): says "again" until the model has answered ``rounds`` times."""

    def __init__(self) -> None:
        self.finished: list[dict[str, Any]] = []

    async def start(self, **interaction_kwargs: Any) -> dict[str, Any]:
        return {"rounds": interaction_kwargs["rounds"], "seen": []}

    async def respond(self, state: Any, response: str) -> Any:
        from hybridflow.agent.interaction import InteractionTurn

        state["seen"].append(response)
        return InteractionTurn(done=len(state["seen"]) >= state["rounds"], text="again")

    async def finish(self, state: Any) -> None:
        self.finished.append(state)


def make_retry_user() -> RetryUser:
    return RetryUser()


def test_interaction_adds_user_turns_per_row(chat: ChatFormat) -> None:
    from hybridflow.agent.interaction import load_interaction

    user = load_interaction(f"{__name__}:make_retry_user")
    assert isinstance(user, RetryUser)
    loop = AgentLoop(ScriptedPolicyDouble(chat), {}, chat, MultiTurnConfig(max_turns=5, max_tokens=200),
                     interaction=user)
    prompts = _prompts(chat, 3)
    # the double's first turn is a call of an unknown tool here (an error tool turn), its later turns answer "done"
    conversations = loop.run(prompts, SamplingParams(max_new_tokens=64),
                             interaction_kwargs=[{"rounds": 1}, {"rounds": 3}, None])
    assert [c.user_turns for c in conversations] == [0, 2, 0]
    assert [c.turns for c in conversations] == [2, 4, 2]
    assert [c.finish for c in conversations] == ["interaction_done", "interaction_done", "stop"]
    user_turn = chat.user_turn_ids("again", ended_with_eos=True)
    second = conversations[1]
    tokens = second.response_ids
    holes = [i for i, g in enumerate(second.generated) if not g]
    assert chat.decode(tokens).count("<|im_start|>user\nagain<|im_end|>") == 2
    assert tokens[holes[-1] - len(user_turn) + 1: holes[-1] + 1] == user_turn  # user ids never in the loss
    assert sorted(len(state["seen"]) for state in user.finished) == [1, 3]
    with pytest.raises(ConfigError, match=r"package\.module:factory"):
        load_interaction("no_colon")
