"""The Qwen2.5-style chat markers and tool chat template the shipped tool task's tokenizer and the test fixtures'
chat tokenizer use: ``<tool_call>``/``</tool_call>`` around a JSON call, tool output in a user turn inside
``<tool_response>``, ``tools=`` rendered as a system block. Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["CHAT_SPECIAL_TOKENS", "CHAT_TEMPLATE", "chat_tokenizer_from_bpe"]

CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                       "<tool_response>", "</tool_response>")

# (transformers renders with trim_blocks: a newline right after a block tag is dropped, hence the {{ "\n" }})
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}"
    "{% endfor %}{{ '\\n' }}</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer_from_bpe(core: Any, corpus: Iterable[str], *, vocab_size: int) -> Any:
    """Train the byte-level BPE ``core`` (a ``tokenizers.Tokenizer`` with its pre-tokenizer and decoder set) on
    ``corpus`` with :data:`CHAT_SPECIAL_TOKENS`, and wrap it as a left-padding ``PreTrainedTokenizerFast`` (EOS
    ``<|im_end|>``, pad ``<|endoftext|>``) with :data:`CHAT_TEMPLATE`."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(list(corpus), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated __init__ in transformers
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(CHAT_SPECIAL_TOKENS[3:]), clean_up_tokenization_spaces=False,
        padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
