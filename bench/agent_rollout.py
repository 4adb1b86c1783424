"""Multi-turn rollout wall time with slow tools vs the same token stream with instant tools (the waits must overlap
with other conversations' generation), and with vs without the engine's KV-cache reuse across turns.

K conversations on the real hf engine (tiny Qwen2, the test chat tokenizer) run ``--turns`` model turns each; a
policy double (``ToolCallingPolicyDouble``: a random model does not write tool calls) has the real engine generate
every turn (greedy), keeps what it wrote up to its first special id and appends a fixed call of the bench's ``wait``
tool, which sleeps L ms. Greedy turns depend only on the conversation, so every run sees the same token stream; the
differences are the tool latency and whether the engine prefills only each turn's new ids (``kv_cache_reuse``, the
default) or the whole conversation (``rollout.extra.kv_cache_reuse: false``). Prints per ``max_batch_rows`` setting
``RESULT {"K", "latency_ms", "max_batch_rows", "wall_s", "no_wait_wall_s", "ratio", "no_reuse_wall_s",
"reuse_speedup", "prefill_tokens", "no_reuse_prefill_tokens", "prefill_saved"}`` (walls: best of ``--repeats``).

Run: ``OMP_NUM_THREADS=1 python bench/agent_rollout.py [--conversations 32] [--latency-ms 50] [--turns 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import results_page
from hybridflow.agent import AgentLoop, ChatFormat, MultiTurnConfig
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TokenCompletion
from hybridflow.testing.chat_tokenizer import build_chat_tokenizer
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow.tools import ToolResult
from hybridflow_fsdp.rollout import HFRolloutEngine

CALL = '<tool_call>{"name": "wait", "arguments": {}}</tool_call>'


class WaitTool:
    """Answers "done" after ``latency_s`` (an I/O-bound tool: a web call, a judge, a sandbox round trip)."""

    name = "wait"
    description: Mapping[str, Any] = {}

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    async def call(self, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolResult:
        await asyncio.sleep(self.latency_s)
        return ToolResult(text="done")


class ToolCallingPolicyDouble:
    """Test double of a policy that always calls the tool: the real engine generates every turn (its compute is the
    cost being measured); the turn is what it wrote up to its first special id, then a fixed tool call."""

    def __init__(self, engine: HFRolloutEngine, chat: ChatFormat) -> None:
        self.engine = engine
        self.capabilities = engine.capabilities
        self.call_ids = tuple(chat.encode(CALL))
        self.special = set(chat.tokenizer.added_tokens_decoder)

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        self.engine.release_cache(keys)

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = (),
                             cache_keys: Sequence[Hashable] | None = None) -> list[TokenCompletion]:
        out = []
        for completion in self.engine.generate_from_tokens(prompts, sampling, cache_keys=cache_keys):
            text = completion.token_ids
            text = text[:next((i for i, t in enumerate(text) if t in self.special), len(text))]
            ids = text + self.call_ids
            out.append(TokenCompletion(token_ids=ids, log_probs=(0.0,) * len(ids), finish_reason="stop"))
        return out


def build_engine(chat: ChatFormat, *, reuse: bool) -> HFRolloutEngine:
    tokenizer = chat.tokenizer
    model = {**tiny_model_config(max_position_embeddings=4096), "vocab_size": len(tokenizer),
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = RolloutEngineConfig(model=ModelSpec(config=model, seed=0), max_prompt_length=512, max_new_tokens=32,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=-1,  # never stops early
                                 extra={"kv_cache_reuse": reuse})
    return HFRolloutEngine(config=config)


def run_once(engine: HFRolloutEngine, chat: ChatFormat, *, conversations: int, latency_s: float, turns: int,
             new_tokens: int, max_batch_rows: int) -> tuple[float, int]:
    loop = AgentLoop(ToolCallingPolicyDouble(engine, chat), {"wait": WaitTool(latency_s)}, chat,
                     MultiTurnConfig(max_turns=turns, max_tokens=4 * turns * new_tokens + 200,
                                     max_batch_rows=max_batch_rows))
    prompts = [chat.render_prompt([{"role": "user", "content": f"task {i}"}]) for i in range(conversations)]
    started = time.perf_counter()
    done = loop.run(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
    return time.perf_counter() - started, sum(len(c.response_ids) for c in done)


def prefilled(engine: HFRolloutEngine, run: Callable[[], tuple[float, int]]) -> tuple[float, int, int]:
    """``run()``'s wall time and tokens, and the ids the engine prefilled meanwhile."""
    before = engine.kv_cache_stats["prefill_tokens"]
    wall, tokens = run()
    return wall, tokens, engine.kv_cache_stats["prefill_tokens"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens the real engine generates per turn")
    parser.add_argument("--max-batch-rows", default="0,16", help="comma-separated settings to compare")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chat = ChatFormat(build_chat_tokenizer())
    engine, no_reuse = build_engine(chat, reuse=True), build_engine(chat, reuse=False)
    for warm in (engine, no_reuse):
        run_once(warm, chat, conversations=4, latency_s=0.0, turns=2, new_tokens=4, max_batch_rows=0)
    for rows in (int(value) for value in args.max_batch_rows.split(",")):
        walls: dict[str, list[float]] = {"wait": [], "no_wait": [], "no_reuse": []}
        counts: dict[str, tuple[int, int]] = {}
        for _ in range(args.repeats):  # interleaved so all three see the same machine load
            for name, target, latency in (("wait", engine, args.latency_ms / 1000), ("no_wait", engine, 0.0),
                                          ("no_reuse", no_reuse, args.latency_ms / 1000)):
                wall, tokens, prefill = prefilled(target, functools.partial(
                    run_once, target, chat, conversations=args.conversations, latency_s=latency, turns=args.turns,
                    new_tokens=args.new_tokens, max_batch_rows=rows))
                walls[name].append(wall)
                counts[name] = (tokens, prefill)
        tokens = {count[0] for count in counts.values()}
        assert len(tokens) == 1, f"the runs saw different token streams: {counts}"
        best = {name: min(values) for name, values in walls.items()}
        prefill, full = counts["wait"][1], counts["no_reuse"][1]
        results_page.result({
            "K": args.conversations, "latency_ms": args.latency_ms, "turns": args.turns, "max_batch_rows": rows,
            "tokens": tokens.pop(), "wall_s": round(best["wait"], 3), "no_wait_wall_s": round(best["no_wait"], 3),
            "ratio": round(best["wait"] / best["no_wait"], 3), "no_reuse_wall_s": round(best["no_reuse"], 3),
            "reuse_speedup": round(best["no_reuse"] / best["wait"], 3), "prefill_tokens": prefill,
            "no_reuse_prefill_tokens": full, "prefill_saved": round(1 - prefill / full, 3)})

if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Multi-turn rollouts with slow tools vs instant tools"))
