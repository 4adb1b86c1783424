"""The tool-call text format (Hermes/Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and the
tool turn's tokens, rendered from the tokenizer's own chat template.

Only new text is ever tokenized: the tool turn (the end of the assistant turn the model did not write, the tool
messages, the next assistant header) is the difference between two renderings of the template, and it is
tokenized alone and appended to the ids the engine produced. Running the tools is :mod:`hybridflow.agent.loop`'s.
Stability: public (experimental).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.errors import ConfigError

__all__ = ["ToolCall", "parse_tool_calls", "ChatFormat", "CALL_START", "CALL_END"]

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_SENTINEL_USER, _SENTINEL_ASSISTANT = "\u2063HFU\u2063", "\u2063HFA\u2063"


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """One call parsed from model text; ``error`` is set (and name/arguments may be anything) when it is malformed."""

    name: Any = None
    arguments: Any = None
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>…</tool_call>`` in ``text``, in order; a malformed one becomes a call with ``error``.

    A ``</tool_call>`` without an opening tag also counts as a (malformed) call, so a model that emits the end
    marker always gets a tool turn back telling it what was wrong.
    """
    calls: list[ToolCall] = []
    bodies = _CALL.findall(text)
    for body in bodies:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(error=f"Error: the tool call is not valid JSON ({exc.msg} at {exc.pos}). "
                                        'Write <tool_call>{"name": "...", "arguments": {...}}</tool_call>.'))
            continue
        if not isinstance(value, dict) or "name" not in value:
            calls.append(ToolCall(error='Error: a tool call must be a JSON object with "name" and "arguments".'))
            continue
        calls.append(ToolCall(name=value["name"], arguments=value.get("arguments", {})))
    if text.count(CALL_END) > len(bodies):
        calls.append(ToolCall(error=f"Error: {CALL_END} without a matching {CALL_START}."))
    return calls


class ChatFormat:
    """A tokenizer plus how its chat template writes tool turns: stop ids, tool-turn text, tokenization.

    With ``tool_turn_prefix``/``tool_turn_suffix`` (and ``tool_separator``) the tool turn is written from them;
    otherwise it is derived from ``tokenizer.apply_chat_template`` (the tokenizer's template must render the
    ``tool`` role and be append-only, as Qwen's and Llama 3's are; one that rewrites earlier turns raises).
    """

    def __init__(self, tokenizer: Any, *, tool_turn_prefix: str | None = None, tool_turn_suffix: str = "",
                 tool_separator: str = "\n") -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.eos_text: str = tokenizer.convert_ids_to_tokens(self.eos_token_id)
        self._explicit = None if tool_turn_prefix is None else (tool_turn_prefix, tool_turn_suffix, tool_separator)
        if self._explicit is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat_template, so the tool turn's markers are unknown; give "
                              "tool_turn_prefix/tool_turn_suffix (rollout.multi_turn) or use a chat tokenizer")
        end_ids = tokenizer.encode(CALL_END, add_special_tokens=False)
        # one token: generation stops right at it; several: the turn runs to EOS and the parser still finds it
        self.stop_token_ids: tuple[int, ...] = (int(end_ids[0]),) if len(end_ids) == 1 else ()
        self._assistant_close = self._derive_assistant_close() if self._explicit is None else ""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def render_prompt(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """Prompt ids: the chat template over ``messages`` with the tool schemas (``tools=``), generation prompt on."""
        text = self.tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, tokenize=False,
                                                  add_generation_prompt=True)
        return self.encode(str(text))

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt))

    def _derive_assistant_close(self) -> str:
        base = [{"role": "user", "content": _SENTINEL_USER}, {"role": "assistant", "content": _SENTINEL_ASSISTANT}]
        return self._render(base, generation_prompt=False).rsplit(_SENTINEL_ASSISTANT, 1)[1]

    def tool_turn_text(self, outputs: Sequence[str], *, ended_with_eos: bool) -> str:
        """The text between the model's last token and its next turn: the close of its turn it did not write, the
        tool messages, the next assistant header."""
        if self._explicit is not None:
            prefix, suffix, separator = self._explicit
            return prefix + separator.join(outputs) + suffix
        return self._turn_text([{"role": "tool", "content": output} for output in outputs], ended_with_eos)

    def user_turn_text(self, content: str, *, ended_with_eos: bool) -> str:
        """The text of a user turn after the model's (an interaction's reply), up to the next assistant header."""
        return self._turn_text([{"role": "user", "content": content}], ended_with_eos)

    def user_turn_ids(self, content: str, *, ended_with_eos: bool) -> list[int]:
        return self.encode(self.user_turn_text(content, ended_with_eos=ended_with_eos))

    def _turn_text(self, messages: list[dict[str, str]], ended_with_eos: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat_template, so a user turn's markers are unknown")
        base = [{"role": "user", "content": _SENTINEL_USER}, {"role": "assistant", "content": _SENTINEL_ASSISTANT}]
        before = self._render(base, generation_prompt=False)
        after = self._render(base + messages, generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError("the tokenizer's chat template is not append-only: adding a message rewrites "
                              "earlier turns, so multi-turn token ids cannot be kept exact. Give "
                              "tool_turn_prefix/tool_turn_suffix explicitly (rollout.multi_turn)")
        close = self._assistant_close or self._derive_assistant_close()
        if ended_with_eos and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]  # the model already wrote the turn's end token
        return close + after[len(before):]

    def tool_turn_ids(self, outputs: Sequence[str], *, ended_with_eos: bool) -> list[int]:
        """Ids of :meth:`tool_turn_text` (tokenized on its own, never merged with the model's ids)."""
        return self.encode(self.tool_turn_text(outputs, ended_with_eos=ended_with_eos))
