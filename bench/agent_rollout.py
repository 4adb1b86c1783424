"""Multi-turn rollout wall time with slow tools vs the same token stream with instant tools (the waits must overlap
with other conversations' generation).

K conversations on the real hf engine (tiny Qwen2, the test chat tokenizer) run ``--turns`` model turns each; a
policy double (``ToolCallingPolicyDouble``: a random model does not write tool calls) runs the real engine for every
turn's generation, then answers with a fixed call of the bench's ``wait`` tool, which sleeps L ms. Both runs see
identical token streams (same seeds, same tool output), so the only difference is the tool latency. Prints
``RESULT {"K", "latency_ms", "max_batch_rows", "wall_s", "no_wait_wall_s", "ratio"}`` per setting.

Run: ``OMP_NUM_THREADS=1 python bench/agent_rollout.py [--conversations 32] [--latency-ms 50] [--turns 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

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
    cost being measured), then the turn's ids are a fixed tool call."""

    def __init__(self, engine: HFRolloutEngine, chat: ChatFormat) -> None:
        self.engine = engine
        self.capabilities = engine.capabilities
        self.call_ids = tuple(chat.encode(CALL))

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def generate_from_tokens(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                             stop_token_ids: Sequence[int] = ()) -> list[TokenCompletion]:
        self.engine.generate_from_tokens(prompts, sampling, stop_token_ids=())
        return [TokenCompletion(token_ids=self.call_ids, log_probs=(0.0,) * len(self.call_ids),
                                finish_reason="stop") for _ in prompts]


def build_engine(chat: ChatFormat) -> HFRolloutEngine:
    tokenizer = chat.tokenizer
    model = {**tiny_model_config(max_position_embeddings=4096), "vocab_size": len(tokenizer),
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = RolloutEngineConfig(model=ModelSpec(config=model, seed=0), max_prompt_length=512, max_new_tokens=32,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=-1)  # never stops early
    return HFRolloutEngine(config=config)


def run_once(engine: HFRolloutEngine, chat: ChatFormat, *, conversations: int, latency_s: float, turns: int,
             new_tokens: int, max_batch_rows: int) -> tuple[float, int]:
    loop = AgentLoop(ToolCallingPolicyDouble(engine, chat), {"wait": WaitTool(latency_s)}, chat,
                     MultiTurnConfig(max_turns=turns, max_tokens=4 * turns * new_tokens + 200,
                                     max_batch_rows=max_batch_rows))
    prompts = [chat.render_prompt([{"role": "user", "content": f"task {i}"}]) for i in range(conversations)]
    started = time.perf_counter()
    done = loop.run(prompts, SamplingParams(max_new_tokens=new_tokens, seed=0))
    return time.perf_counter() - started, sum(len(c.response_ids) for c in done)


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
    engine = build_engine(chat)
    run_once(engine, chat, conversations=4, latency_s=0.0, turns=2, new_tokens=4, max_batch_rows=0)  # warm up
    for rows in (int(value) for value in args.max_batch_rows.split(",")):
        waits, no_waits = [], []
        for _ in range(args.repeats):  # alternate so both see the same machine load
            wall, tokens = run_once(engine, chat, conversations=args.conversations,
                                    latency_s=args.latency_ms / 1000, turns=args.turns,
                                    new_tokens=args.new_tokens, max_batch_rows=rows)
            base, base_tokens = run_once(engine, chat, conversations=args.conversations, latency_s=0.0,
                                         turns=args.turns, new_tokens=args.new_tokens, max_batch_rows=rows)
            assert tokens == base_tokens, (tokens, base_tokens)
            waits.append(wall)
            no_waits.append(base)
        wall, base = min(waits), min(no_waits)
        print("RESULT " + json.dumps({"K": args.conversations, "latency_ms": args.latency_ms, "turns": args.turns,
                                      "max_batch_rows": rows, "tokens": tokens, "wall_s": round(wall, 3),
                                      "no_wait_wall_s": round(base, 3), "ratio": round(wall / base, 3)}), flush=True)


if __name__ == "__main__":
    main()
