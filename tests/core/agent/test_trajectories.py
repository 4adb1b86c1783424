"""Training sequences from recorded calls, by token ids alone: prefix-extending calls merge (the ids between two
completions are attended, not trained), a call that extends nothing roots a new sequence, choices of one prompt
branch, and a record whose log-probs do not match its completion is refused."""

from __future__ import annotations

import pytest

from hybridflow.agent.trajectories import CallRecord, build_sequences


def _call(index: int, prompt: list[int], completion: list[int]) -> CallRecord:
    return CallRecord(index=index, prompt_ids=tuple(prompt), completion_ids=tuple(completion),
                      log_probs=tuple(-0.1 * (index + 1) for _ in completion), finish_reason="stop")


def test_extending_calls_merge_and_others_split() -> None:
    first = _call(0, [1, 2, 3], [4, 5])
    second = _call(1, [1, 2, 3, 4, 5, 9, 9], [6])  # a tool turn (9, 9) then the model's next turn
    edited = _call(2, [1, 2, 3, 7], [8])  # the agent rewrote its context: extends no call
    third = _call(3, [1, 2, 3, 4, 5, 9, 9, 6, 9], [10, 11])
    split, merged = build_sequences([third, edited, second, first])  # any order in; by their last call
    assert merged.calls == [0, 1, 3] and split.calls == [2]
    assert merged.prompt_ids == [1, 2, 3] and merged.response_ids == [4, 5, 9, 9, 6, 9, 10, 11]
    assert merged.generated == [1, 1, 0, 0, 1, 0, 1, 1]
    assert merged.log_probs == [-0.1, -0.1, 0.0, 0.0, -0.2, 0.0, -0.4, -0.4]
    assert split.prompt_ids == [1, 2, 3, 7] and split.response_ids == [8] and split.generated == [1]


def test_choices_of_one_prompt_branch_and_the_longest_parent_wins() -> None:
    # n = 2 choices of one prompt; the agent continues the second; a later call starts afresh
    calls = [_call(0, [1, 2], [3]), _call(1, [1, 2], [4]), _call(2, [1, 2, 4, 5], [6]), _call(3, [1], [2])]
    sequences = build_sequences(calls)
    assert [s.calls for s in sequences] == [[0], [1, 2], [3]]
    assert sequences[1].ids == [1, 2, 4, 5, 6] and sequences[1].generated == [1, 0, 1]
    # both earlier calls' ids are prefixes of the last prompt: the longer one is its parent, one chain
    chain = build_sequences([_call(0, [1], [2]), _call(1, [1, 2], [3]), _call(2, [1, 2, 3, 9], [4])])
    assert [s.calls for s in chain] == [[0, 1, 2]] and chain[0].generated == [1, 1, 0, 1]


def test_log_probs_must_match_the_completion() -> None:
    bad = CallRecord(index=0, prompt_ids=(1,), completion_ids=(2, 3), log_probs=(-1.0,), finish_reason="stop")
    with pytest.raises(ValueError, match="2 completion ids but 1 log-probs"):
        build_sequences([bad])
