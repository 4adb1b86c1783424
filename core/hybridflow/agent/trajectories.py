"""The calls an OpenAI-compatible endpoint served for one sample, recorded token for token, and the training
sequences rebuilt from them without re-tokenizing anything the model generated.

A call's record holds the exact prompt ids the engine was given, the ids it sampled and their log-probs, plus the
text the prompt ids stand for (so the endpoint can tell whether a later chat prompt extends it). Sequences follow
AReaL's ``concat`` export: each call's parent is the earlier call whose prompt + completion is the longest prefix of
its prompt ids; a chain of such calls is one sequence (the ids between the parent's completion and the child's
completion are the tool/user turns: attended, not trained); every leaf of the call tree ends one sequence. A call
that extends no earlier call (a template that dropped earlier reasoning, an agent that edited its context) roots a
new sequence of the same sample. Serving calls is :mod:`hybridflow.agent.endpoint`'s. Stability: experimental.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["CallRecord", "TrajectorySequence", "SessionLog", "build_sequences"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CallRecord:
    """One completion the engine produced for one session: ``prompt_ids`` in, ``completion_ids`` out (ending with the
    stop id when ``finish_reason == "stop"``), one log-prob per completion id. ``prompt_text`` is the text the prompt
    ids stand for (chat calls: the rendered template; token-id completions: empty) and ``completion_text`` the
    decoded completion, special ids included."""

    index: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str
    prompt_text: str = ""
    completion_text: str = ""
    #: the number of tool calls parsed from the completion (chat calls)
    tool_calls: int = 0
    #: the index of the call whose ids this prompt was spliced onto (None: tokenized whole, or token ids given)
    spliced_on: int | None = None

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.completion_ids

    @property
    def text(self) -> str:
        return self.prompt_text + self.completion_text


@dataclass(slots=True)
class TrajectorySequence:
    """One training sequence of a sample: ``prompt_ids`` then ``response_ids``; ``generated[i]`` is 1 where the model
    sampled the id (its log-prob in ``log_probs``), 0 on the turns between calls; ``calls`` the records it holds."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def _is_prefix(prefix: Sequence[int], ids: Sequence[int]) -> bool:
    return len(prefix) <= len(ids) and tuple(ids[:len(prefix)]) == tuple(prefix)


def build_sequences(calls: Sequence[CallRecord]) -> list[TrajectorySequence]:
    """The training sequences of one sample's calls (in call order), one per leaf of the call tree, in the order of
    their last call. Raises ``ValueError`` when a record's log-probs do not match its completion."""
    ordered = sorted(calls, key=lambda call: call.index)
    parent: dict[int, int | None] = {}
    for position, call in enumerate(ordered):
        if len(call.log_probs) != len(call.completion_ids):
            raise ValueError(f"call {call.index} recorded {len(call.completion_ids)} completion ids but "
                             f"{len(call.log_probs)} log-probs")
        best: int | None = None
        for slot, earlier in enumerate(ordered[:position]):
            if _is_prefix(earlier.ids, call.prompt_ids) and (
                    best is None or len(earlier.ids) > len(ordered[best].ids)):
                best = slot
        parent[position] = best
    has_child = {p for p in parent.values() if p is not None}
    sequences = []
    for position in range(len(ordered)):
        if position in has_child:
            continue
        chain = [position]
        while (up := parent[chain[-1]]) is not None:
            chain.append(up)
        chain.reverse()
        root = ordered[chain[0]]
        sequence = TrajectorySequence(prompt_ids=list(root.prompt_ids))
        for step in chain:
            call = ordered[step]
            between = call.prompt_ids[len(sequence.ids):]  # the turns appended since the parent's completion
            sequence.response_ids.extend(between)
            sequence.generated.extend([0] * len(between))
            sequence.log_probs.extend([0.0] * len(between))
            sequence.response_ids.extend(call.completion_ids)
            sequence.generated.extend([1] * len(call.completion_ids))
            sequence.log_probs.extend(call.log_probs)
            sequence.calls.append(call.index)
        sequences.append(sequence)
    return sequences


class SessionLog:
    """The records of one session (thread-safe: the endpoint's event loop writes, the rollout reads after)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[CallRecord] = []
        self._reserved = 0

    def reserve(self) -> int:
        """The index of the session's next call (unique among concurrent calls)."""
        with self._lock:
            self._reserved += 1
            return self._reserved - 1

    def add(self, record: CallRecord) -> None:
        with self._lock:
            self._calls.append(record)

    def calls(self) -> list[CallRecord]:
        with self._lock:
            return list(self._calls)

    def longest_text_prefix(self, text: str) -> CallRecord | None:
        """The recorded chat call whose prompt + completion text is the longest prefix of ``text`` (None if none)."""
        best: CallRecord | None = None
        for call in self.calls():
            if call.prompt_text and text.startswith(call.text) and (best is None or len(call.text) > len(best.text)):
                best = call
        return best
