"""A tiny byte-level BPE chat tokenizer with Qwen-style markers and tool template, built locally (no hub access).

Merges make the multi-turn hazards real: text re-tokenized across a turn boundary can merge differently from the
ids the model produced, which is what the agent tests check never happens. ``<tool_call>``/``</tool_call>`` are
single (added) tokens, as in Qwen. Stability: testing fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridflow.agent.templates import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE, chat_tokenizer_from_bpe

__all__ = ["CHAT_SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_chat_tokenizer", "save_tiny_chat_model"]

_TRAINING_TEXT = [
    "What is 123 times 456? Let me use the calculator.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>',
    "The answer is 56088. Paris is the capital of France. Error: unknown tool. Traceback (most recent call last)",
    "user assistant system tools function name arguments expression query code print result",
]


def build_chat_tokenizer(vocab_size: int = 320) -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE, ``vocab_size`` ids, EOS ``<|im_end|>``) with a chat template
    that renders ``tools=`` and the ``tool`` role like Qwen2.5's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = _TRAINING_TEXT * 4 + [json.dumps({"n": n, "text": f"{n} * {n + 7} = {n * (n + 7)}"}) for n in range(50)]
    return chat_tokenizer_from_bpe(core, corpus, vocab_size=vocab_size)


def save_tiny_chat_model(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """An HF model directory: a tiny random-init Qwen2 over :func:`build_chat_tokenizer`'s vocabulary, saved with that
    tokenizer (so ``model.path`` gives a run a chat template, as multi-turn rollouts need)."""
    import torch
    import transformers

    from hybridflow.presets import tiny_model_config

    tokenizer = build_chat_tokenizer()
    config = {**tiny_model_config(max_position_embeddings=2048), "vocab_size": len(tokenizer),
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
              **config_overrides}
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"},
                                                  architectures=config["architectures"])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    target = Path(path)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
