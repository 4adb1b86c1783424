"""The tool-calculator task: "What is a*b?" for two-digit ``a``, ``b`` (products up to 9801), which a tiny model
cannot compute but can answer by calling the ``calculator`` tool and copying its result; a reward on the final
answer; the shipped SFT demonstrations (multi-turn ``messages``, some with the tool and some without) and RL prompts.

It makes data and scores text. Running the conversations is :mod:`hybridflow.agent`'s, the tool is
:mod:`hybridflow.tools`'. Stability: public (experimental).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.agent.templates import chat_tokenizer_from_bpe

__all__ = ["DATA_SOURCE", "TOOL", "make_tool_calc_rows", "make_tool_calc_sft_rows", "final_answer", "tool_calc_reward",
           "tool_call_text", "write_tool_calc_files", "save_tool_calc_model", "build_tool_calc_tokenizer", "main",
           "SFT_FILE", "TRAIN_FILE", "VAL_FILE"]

DATA_SOURCE = "hybridflow/tool_calc"
TOOL = "calculator"
#: the shipped files (examples/data/), made by :func:`write_tool_calc_files`
SFT_FILE, TRAIN_FILE, VAL_FILE = "tool_calc_sft.jsonl", "tool_calc_train.jsonl", "tool_calc_val.jsonl"
_TRAILING_INTEGER = re.compile(r"(-?\d+)\s*$")


def _question(a: int, b: int) -> str:
    return f"{a}*{b}"


def tool_call_text(expression: str) -> str:
    """The Hermes/Qwen tool call the demonstrations make (``<tool_call>{json}</tool_call>``)."""
    body = json.dumps({"name": TOOL, "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


def _operands(rng: random.Random, low: int, high: int) -> tuple[int, int]:
    return rng.randint(low, high), rng.randint(low, high)


def make_tool_calc_rows(*, num_rows: int, seed: int = 0, low: int = 10, high: int = 99,
                        exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """RL prompts in verl's layout: ``prompt`` (chat messages), ``data_source``, ``reward_model.ground_truth``,
    ``extra_info`` (with ``tools_kwargs`` naming the tool, as verl's multi-turn data does); no prompt in ``exclude``."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    while len(rows) < num_rows:
        a, b = _operands(rng, low, high)
        question = _question(a, b)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": [{"role": "user", "content": question}], "data_source": DATA_SOURCE,
                     "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                     "extra_info": {"index": len(rows), "tools_kwargs": {TOOL: {}}}})
    return rows


def make_tool_calc_sft_rows(*, num_rows: int = 256, seed: int = 1000, tool_fraction: float = 0.5, low: int = 10,
                            high: int = 99, exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Multi-turn demonstrations (verl's SFT ``messages`` column): a ``tool_fraction`` of them call the calculator
    and copy its result, the others answer straight away (with the right product, which a tiny model cannot learn
    to compute: those teach a guess). ``tools`` holds the function schemas the prompt is rendered with."""
    from hybridflow.tools import build_tools

    schemas = [dict(tool.description) for tool in build_tools([TOOL]).values()]
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    while len(rows) < num_rows:
        a, b = _operands(rng, low, high)
        question = _question(a, b)
        if question in seen:
            continue
        seen.add(question)
        answer = str(a * b)
        messages: list[dict[str, str]] = [{"role": "user", "content": question}]
        if rng.random() < tool_fraction:
            messages += [{"role": "assistant", "content": tool_call_text(question)},
                         {"role": "tool", "content": answer}]
        messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages, "tools": schemas, "data_source": DATA_SOURCE,
                     "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"index": len(rows)}})
    return rows


def final_answer(response: str) -> str:
    """The integer the model's text ends with ("" if none): its final answer. Rewards read only the model's tokens
    (tool output is masked out, special tokens skipped), so after a tool call this is what it wrote last."""
    match = _TRAILING_INTEGER.search(response.strip())
    return match.group(1) if match else ""


def tool_calc_reward(*, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                     extra: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """1.0 when the final answer (:func:`final_answer`) is the product, else 0.0."""
    return [1.0 if final_answer(r) == str(g).strip() else 0.0 for r, g in zip(responses, ground_truths)]


def write_tool_calc_files(directory: str | Path, *, num_train: int = 512, num_val: int = 32,
                          num_sft: int = 256) -> list[Path]:
    """Write the SFT demonstrations, the RL prompts and the held-out validation prompts (disjoint; deterministic)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    val = make_tool_calc_rows(num_rows=num_val, seed=2)
    train = make_tool_calc_rows(num_rows=num_train, seed=1, exclude=[r["prompt"][0]["content"] for r in val])
    sft = make_tool_calc_sft_rows(num_rows=num_sft, exclude=[r["prompt"][0]["content"] for r in val])
    paths = []
    for name, rows in ((SFT_FILE, sft), (TRAIN_FILE, train), (VAL_FILE, val)):
        path = directory / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        paths.append(path)
    return paths


def build_tool_calc_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE chat tokenizer for the task (Qwen-style markers and tool template, EOS ``<|im_end|>``) whose
    merges are learned from the task's own system turn and tool calls, so those render in few tokens; digits are
    always single tokens (a number is copied digit by digit)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hybridflow.tools import build_tools

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])
    core.decoder = decoders.ByteLevel()
    schemas = [dict(tool.description) for tool in build_tools([TOOL, "python"]).values()]
    corpus = [json.dumps(schema) for schema in schemas] * 8 + [tool_call_text("12*34")] * 8 + [
        "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>", "system user assistant tools",
        "Error: unknown tool. Traceback (most recent call last)"] * 4
    return chat_tokenizer_from_bpe(core, corpus, vocab_size=vocab_size)


def save_tool_calc_model(path: str | Path, *, seed: int = 0, hidden_size: int = 128, num_layers: int = 2,
                         num_heads: int = 4) -> Path:
    """The task's starting point: a tiny random-init Qwen2-shaped model over :func:`build_tool_calc_tokenizer`,
    saved with that tokenizer as an HF directory (SFT's ``model.path``)."""
    import torch
    import transformers

    from hybridflow.presets import tiny_model_config

    tokenizer = build_tool_calc_tokenizer()
    config = {**tiny_model_config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_layers=num_layers,
                                  num_heads=num_heads, num_kv_heads=num_heads // 2, max_position_embeddings=1024),
              "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"},
                                                  architectures=config["architectures"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    target = Path(path)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main(argv: Sequence[str]) -> int:
    """``python -m hybridflow.tasks.tool_calc [DATA_DIR] [--init-model DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hybridflow.tasks.tool_calc", description=(
        "Write the tool-calculator task's files (SFT demonstrations, RL prompts, validation prompts) and, with "
        "--init-model, the random-init chat model that examples/sft_tool_calc.yaml starts from."))
    parser.add_argument("data_dir", nargs="?", default="examples/data")
    parser.add_argument("--init-model", help="also save the tiny random-init chat model here (an HF directory)")
    parser.add_argument("--no-data", action="store_true", help="do not (re)write the data files")
    args = parser.parse_args(list(argv))
    if not args.no_data:
        for written in write_tool_calc_files(args.data_dir):
            print(written)
    if args.init_model:
        print(save_tool_calc_model(args.init_model))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
