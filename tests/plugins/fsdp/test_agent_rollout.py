"""Multi-turn agent rollouts on the real hf engine: the trained ids are exactly the ids the engine saw and produced
plus the tool-turn ids, the masks cover exactly the model's ids, and failing tools become tool turns.

A tiny random model almost never writes a well-formed tool call, so :class:`ScriptedToolCallerDouble` forces some
turns to be scripted calls (named as a double: it stands in for a trained policy's *choice* to call a tool); every
other turn, and every turn's prefix handling, goes through the real :class:`HFRolloutEngine`.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hybridflow.agent import AgentLoop, ChatFormat, MultiTurnConfig, build_rollout_batch, summarize_agent_metrics
from hybridflow.agent.loop import tool_schemas
from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TokenCompletion
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow.tools import build_tools
from hybridflow_fsdp.rollout import HFRolloutEngine

SCRIPTED_CALLS = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "%d*%d"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "%d*%d"</tool_call>',  # bad JSON
    '<tool_call>{"name": "abacus", "arguments": {"x": "%d+%d"}}</tool_call>',  # unknown tool
    '<tool_call>{"name": "python", "arguments": {"code": "print(%d // 0 + %d)"}}</tool_call>',  # exception
    '<tool_call>{"name": "python", "arguments": {"code": "import time\\ntime.sleep(30)"}}</tool_call>',  # hang
    '<tool_call>{"name": "python", "arguments": {"code": "import os\\nos.fork()"}}</tool_call>',  # fork: denied
    '<tool_call>{"name": "python", "arguments": {"code": "print(open(\'/etc/passwd\').read())"}}</tool_call>',
]


@dataclass
class ScriptedToolCallerDouble:
    """Test double of a policy that decides to call tools: with probability ``p_call`` a prefix is continued with a
    scripted call's ids (log-prob 0), otherwise by the real engine. It records every (prefix, completion) pair."""

    engine: HFRolloutEngine
    chat_format: ChatFormat
    p_call: float = 0.5
    seed: int = 0
    cycle: bool = False  # scripted calls in SCRIPTED_CALLS order (every kind shows up) instead of at random
    #: a scripted turn starts with what the engine generated for it (up to its first special id, at most a quarter
    #: of the turn), as a model writing some text before its call; the engine then holds keys/values of that text
    continue_real: bool = False
    events: list[tuple[tuple[int, ...], TokenCompletion]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.capabilities = self.engine.capabilities
        self.rng = random.Random(self.seed)
        self.scripted = 0

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        self.engine.release_cache(keys)

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = (),
                             cache_keys: Sequence[Hashable] | None = None) -> list[TokenCompletion]:
        scripted = [self.rng.random() < self.p_call for _ in prompts]
        real_rows = [row for row, s in enumerate(scripted) if not s or self.continue_real]
        real = self.engine.generate_from_tokens([prompts[row] for row in real_rows], sampling,
                                                stop_token_ids=stop_token_ids,
                                                cache_keys=None if cache_keys is None else
                                                [cache_keys[row] for row in real_rows])
        by_row = dict(zip(real_rows, real))
        out = []
        special = set(self.chat_format.tokenizer.added_tokens_decoder)
        for row, prompt in enumerate(prompts):
            completion = by_row.get(row)
            if scripted[row]:
                template = SCRIPTED_CALLS[self.scripted % len(SCRIPTED_CALLS)] if self.cycle else \
                    self.rng.choice(SCRIPTED_CALLS)
                self.scripted += 1
                text = template % tuple(self.rng.randint(10, 99) for _ in range(template.count("%d")))
                head: tuple[int, ...] = ()
                head_log_probs: tuple[float, ...] = ()
                if completion is not None:  # continue_real
                    cut = next((i for i, t in enumerate(completion.token_ids) if t in special),
                               len(completion.token_ids))
                    cut = min(cut, sampling.max_new_tokens // 4)
                    head, head_log_probs = completion.token_ids[:cut], completion.log_probs[:cut]
                ids = (head + tuple(self.chat_format.encode(text)))[: sampling.max_new_tokens]
                completion = TokenCompletion(token_ids=ids, log_probs=(head_log_probs + (0.0,) * len(ids))[:len(ids)],
                                             finish_reason="stop" if ids[-1] in stop_token_ids else "length")
            assert completion is not None
            self.events.append((tuple(int(t) for t in prompt), completion))
            out.append(completion)
        return out


@pytest.fixture(scope="module")
def chat_format() -> ChatFormat:
    return ChatFormat(build_chat_tokenizer())


@pytest.fixture(scope="module")
def engine(chat_format: ChatFormat) -> HFRolloutEngine:
    tokenizer = chat_format.tokenizer
    model = {**tiny_model_config(max_position_embeddings=2048), "vocab_size": len(tokenizer),
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = RolloutEngineConfig(model=ModelSpec(config=model, seed=3), max_prompt_length=512, max_new_tokens=24,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return HFRolloutEngine(config=config)


def _prompt_batch(chat_format: ChatFormat, prompts: list[list[int]]) -> Batch:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), chat_format.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return Batch({"input_ids": ids, "attention_mask": mask})


def test_generate_from_tokens_batches_like_single_rows(engine: HFRolloutEngine) -> None:
    """Left-padding variable-length prefixes into one batch changes nothing (greedy, row by row)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(7, 300) for _ in range(length)] for length in (3, 17, 9, 30)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    together = engine.generate_from_tokens(prefixes, greedy, stop_token_ids=(4,))
    alone = [engine.generate_from_tokens([p], greedy, stop_token_ids=(4,))[0] for p in prefixes]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for a, b in zip(together, alone):
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4)
        assert len(a.token_ids) == 12 or a.token_ids[-1] in (4, engine.config.eos_token_id)


def test_multi_turn_ids_are_exact_and_masks_cover_the_model(engine: HFRolloutEngine, chat_format: ChatFormat) -> None:
    tools = build_tools(["calculator", "python"])
    rng = random.Random(1)
    prompts = [chat_format.render_prompt([{"role": "user", "content": f"What is {rng.randint(100, 999)} times "
                                           f"{rng.randint(100, 999)}? ({i})"}], tool_schemas(tools))
               for i in range(24)]
    double = ScriptedToolCallerDouble(engine=engine, chat_format=chat_format, p_call=0.6, continue_real=True)
    config = MultiTurnConfig(max_turns=4, max_tokens=400, tool_timeout_s=1.0)
    loop = AgentLoop(double, tools, chat_format, config)
    before = engine.kv_cache_stats
    conversations = loop.run(prompts, SamplingParams(temperature=1.0, max_new_tokens=48, seed=5))
    # the default path reuses each conversation's keys/values across turns and frees them when it ends
    after = engine.kv_cache_stats
    # (every turn goes through the engine here: a conversation's turns after its first continue its entry, and
    # prefill only its new ids: the tool turn, the scripted call and at most one sampled id)
    assert loop.reuse is double and after["entries"] == 0
    assert after["misses"] - before["misses"] == len(prompts)
    assert after["hits"] - before["hits"] == sum(c.turns - 1 for c in conversations)
    continued = after["prefill_tokens"] - before["prefill_tokens"] - sum(len(p) for p in prompts)
    assert after["reused_tokens"] - before["reused_tokens"] > 5 * continued
    batch = build_rollout_batch(_prompt_batch(chat_format, prompts), conversations, width=config.max_tokens,
                                pad_token_id=chat_format.tokenizer.pad_token_id, policy_version=0)

    multi_turn = 0
    retokenization_would_differ = 0
    for row, conversation in enumerate(conversations):
        full = conversation.prompt_ids + conversation.response_ids
        # the trained row is exactly prompt + response ids, the padding outside it
        attended = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        assert attended == full
        assert batch["prompts"][row][batch["attention_mask"][row, : batch["prompts"].shape[1]].bool()].tolist() \
            == prompts[row]
        events = [(p, c) for p, c in double.events if list(p[: len(prompts[row])]) == prompts[row]]
        assert len(events) == conversation.turns
        expected_mask = [0] * len(conversation.response_ids)
        expected_log_probs = [0.0] * len(conversation.response_ids)
        for prefix, completion in events:
            # every turn's prefix is the trained sequence so far; what the engine produced sits right after it
            assert list(prefix) == full[: len(prefix)]
            start = len(prefix) - len(prompts[row])
            kept = min(len(completion.token_ids), len(conversation.response_ids) - start)
            if kept < len(completion.token_ids):  # only the token budget may cut a turn short: at its end
                assert (prefix, completion) == events[-1] and len(conversation.response_ids) == config.max_tokens
            assert conversation.response_ids[start: start + kept] == list(completion.token_ids[:kept])
            for offset, log_prob in enumerate(completion.log_probs[:kept]):
                expected_mask[start + offset] = 1
                expected_log_probs[start + offset] = log_prob
        length = len(conversation.response_ids)
        assert batch["response_mask"][row, :length].tolist() == expected_mask
        assert batch["response_mask"][row, length:].sum() == 0
        assert torch.allclose(batch["rollout_log_probs"][row, :length], torch.tensor(expected_log_probs))
        assert batch["rollout_log_probs"][row][batch["response_mask"][row] == 0].abs().sum() == 0
        # every hole in the mask is a tool turn: it decodes to the template's tool-response markers
        holes = [i for i in range(length) if expected_mask[i] == 0]
        if holes:
            assert "<tool_response>" in chat_format.decode([conversation.response_ids[i] for i in holes])
        multi_turn += conversation.turns > 1
        retokenization_would_differ += chat_format.encode(chat_format.decode(full)) != full
    assert multi_turn >= 8
    # the hazard is real here: decoding and re-encoding would have changed some sequences
    assert retokenization_would_differ >= 1
    # positions run on through the tool turns (the model reads them); columns as engines.py documents
    assert batch["input_ids"].shape == (24, batch["prompts"].shape[1] + config.max_tokens)
    metrics = summarize_agent_metrics(batch)
    assert metrics["num_turns/max"] <= 4 and metrics["num_turns/min"] >= 1
    assert metrics["tool_call_counts/mean"] == pytest.approx(sum(c.tool_calls for c in conversations) / 24)


def test_failing_tools_become_tool_turns(engine: HFRolloutEngine, chat_format: ChatFormat) -> None:
    """Every scripted failure (bad JSON, unknown tool, exception, hang past the timeout, fork, /etc/passwd) comes back
    as a tool turn; the rollout completes and the statuses are counted."""
    tools = build_tools(["calculator", "python"])
    prompts = [chat_format.render_prompt([{"role": "user", "content": f"task {i}"}], tool_schemas(tools))
               for i in range(12)]
    double = ScriptedToolCallerDouble(engine=engine, chat_format=chat_format, p_call=1.0, cycle=True)
    loop = AgentLoop(double, tools, chat_format, MultiTurnConfig(max_turns=3, max_tokens=600, tool_timeout_s=3.0))
    conversations = loop.run(prompts, SamplingParams(max_new_tokens=64, seed=1))
    statuses: dict[str, int] = {}
    for conversation in conversations:
        assert conversation.turns == 3 and conversation.finish == "max_turns"
        assert conversation.tool_calls == 2
        for status, count in conversation.tool_statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    assert {"ok", "bad_call", "unknown_tool", "error", "timeout", "denied"} <= set(statuses)
    texts = [chat_format.decode(c.response_ids) for c in conversations]
    assert any("timed out after 3 s" in t for t in texts)
    assert any("sandbox: denied open '/etc/passwd'" in t for t in texts)
    assert not any("root:x:0:0" in t for t in texts)


def test_hang_does_not_block_other_conversations(engine: HFRolloutEngine, chat_format: ChatFormat) -> None:
    """A tool hanging for its whole timeout does not hold back the others: while it waits, the rest keep going."""
    tools = build_tools(["python"])

    @dataclass
    class OneHangDouble(ScriptedToolCallerDouble):
        """Row 0's first turn calls a hanging tool; everyone else ends after one real turn."""

        def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                                 stop_token_ids: Sequence[int] = (),
                                 cache_keys: Sequence[Hashable] | None = None) -> list[TokenCompletion]:
            out = self.engine.generate_from_tokens(prompts, sampling, stop_token_ids=stop_token_ids,
                                                   cache_keys=cache_keys)
            self.events.append((tuple(len(p) for p in prompts), out[0]))
            if len(self.events) == 1:
                ids = tuple(self.chat_format.encode(SCRIPTED_CALLS[4]))
                out[0] = TokenCompletion(token_ids=ids, log_probs=(0.0,) * len(ids), finish_reason="stop")
            return out

    prompts = [chat_format.render_prompt([{"role": "user", "content": f"q{i}"}]) for i in range(6)]
    double = OneHangDouble(engine=engine, chat_format=chat_format)
    loop = AgentLoop(double, tools, chat_format, MultiTurnConfig(max_turns=2, max_tokens=200, tool_timeout_s=2.0))
    conversations = loop.run(prompts, SamplingParams(max_new_tokens=8, seed=2))
    assert conversations[0].tool_statuses["timeout"] == 1
    # the second generate call holds row 0 alone: the other rows had finished without waiting for the hang
    assert len(double.events[1][0]) == 1
    assert all(c.finish for c in conversations)


def test_loop_refuses_an_engine_without_the_capability(chat_format: ChatFormat) -> None:
    class NoPrefixEngine:
        capabilities = frozenset({"sleep"})
        weights_version = 0

    with pytest.raises(Exception, match="continue_from_tokens"):
        AgentLoop(NoPrefixEngine(), {}, chat_format, MultiTurnConfig())  # type: ignore[arg-type]



def test_run_from_inside_an_event_loop(engine: HFRolloutEngine, chat_format: ChatFormat) -> None:
    """``AgentLoop.run`` called from async code (an async actor, a notebook) still completes."""
    import asyncio

    loop = AgentLoop(engine, {}, chat_format, MultiTurnConfig(max_turns=1, max_tokens=8))

    async def inside() -> int:
        return len(loop.run([chat_format.render_prompt([{"role": "user", "content": "hi"}])],
                            SamplingParams(max_new_tokens=4, seed=0)))

    assert asyncio.run(inside()) == 1


def test_trainer_agent_path_passes_cache_keys_and_frees_them(tmp_path: Path, chat_format: ChatFormat) -> None:
    """``rollout.multi_turn.enable``'s worker path (``AgentRollout``) over the hf engine continues conversations from
    their kept keys/values by default: every conversation's first turn is looked up under its key (a miss), and
    nothing stays held after the batch."""
    from hybridflow.agent.worker import AgentRollout
    from hybridflow.testing.chat_tokenizer import save_tiny_chat_model

    tokenizer = chat_format.tokenizer
    config = RolloutEngineConfig(model=ModelSpec(path=str(save_tiny_chat_model(tmp_path / "model"))),
                                 max_prompt_length=128, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    engine = HFRolloutEngine(config=config)
    rollout = AgentRollout(engine, config, {"max_turns": 2, "max_tokens": 32, "tool_timeout_s": 1.0,
                                            "max_tool_calls_per_turn": 2, "max_batch_rows": 0,
                                            "tools": ["calculator"]})
    assert rollout.loop.reuse is engine
    prompts = [chat_format.render_prompt([{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    out = rollout.generate(_prompt_batch(chat_format, prompts), SamplingParams(max_new_tokens=8, n=2, seed=0))
    assert out["responses"].shape[0] == 6
    stats = engine.kv_cache_stats
    assert stats["misses"] == 6 and stats["entries"] == 0 and stats["held_bytes"] == 0
