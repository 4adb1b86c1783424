"""Partial rollout (``rollout.partial_rollout``, hybridflow.workers.partial_rollout): the segment bookkeeping (which
rows go on, with which prefix, for how many tokens; the rollout columns and per-token versions at the end), and the
rollout worker generating in segments with the real HF engine (called in this process instead of through Ray):
under one set of weights, greedy segments give the tokens and log-probs of one uninterrupted generation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, TokenCompletion, TrainingEngineConfig
from hybridflow.errors import EngineError
from hybridflow.presets import preset_model_config
from hybridflow.workers.partial_rollout import TOKEN_VERSIONS, SegmentedRollout, WeightMailbox, unpadded_prompts

PAD = 0


def _prompts(rows: list[list[int]]) -> Batch:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = torch.tensor(row)
        mask[index, width - len(row):] = 1
    return Batch({"input_ids": ids, "attention_mask": mask}, {"uid": [f"p{i}" for i in range(len(rows))]},
                 {"iteration": 3, "policy_version": 1})


def _completion(ids: list[int], stop: bool = False) -> TokenCompletion:
    return TokenCompletion(token_ids=tuple(ids), log_probs=tuple(-0.5 * (i + 1) for i in range(len(ids))),
                           finish_reason="stop" if stop else "length")


def test_segments_continue_unfinished_rows_and_record_each_tokens_version() -> None:
    prompts = _prompts([[5, 6, 7], [8], [9, 10]])
    state = SegmentedRollout(unpadded_prompts(prompts), max_new_tokens=5, segment_tokens=2)
    assert state.prefixes([0, 1, 2]) == [[5, 6, 7], [8], [9, 10]] and state.budget([0, 1, 2]) == 2
    state.extend([0, 1, 2], [_completion([2], stop=True), _completion([11, 12]), _completion([13, 14])],
                 version=1, budget=2)  # row 0 stops at EOS (2) in the first segment
    assert state.unfinished() == [1, 2] and state.prefixes([1, 2]) == [[8, 11, 12], [9, 10, 13, 14]]
    state.extend([1, 2], [_completion([15, 16]), _completion([2], stop=True)], version=2, budget=2)
    assert state.unfinished() == [1] and state.budget([1]) == 1  # 4 of 5 tokens: the last segment is shorter
    state.extend([1], [_completion([17])], version=4, budget=1)
    assert state.unfinished() == [] and state.segments == 3

    out = state.to_batch(prompts, pad_token_id=PAD, policy_version=1)
    assert out["responses"].tolist() == [[2, 0, 0, 0, 0], [11, 12, 15, 16, 17], [13, 14, 2, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out[TOKEN_VERSIONS].tolist() == [[1, -1, -1, -1, -1], [1, 1, 2, 2, 4], [1, 1, 2, -1, -1]]
    assert out["rollout_log_probs"].tolist() == [[-0.5, 0, 0, 0, 0], [-0.5, -1.0, -0.5, -1.0, -0.5],
                                                 [-0.5, -1.0, -0.5, 0, 0]]
    assert out["input_ids"].tolist()[1] == [0, 0, 8, 11, 12, 15, 16, 17]
    assert out["attention_mask"].tolist()[2] == [0, 1, 1, 1, 1, 1, 0, 0]
    assert out["position_ids"].tolist()[1] == [0, 0, 0, 1, 2, 3, 4, 5]  # the prompt's from its first real id on
    assert out.meta == {"iteration": 3, "policy_version": 1} and list(out["uid"]) == ["p0", "p1", "p2"]
    with pytest.raises(EngineError, match="version 1, older than the version 2"):
        state.to_batch(prompts, pad_token_id=PAD, policy_version=2)


def test_an_engine_breaking_the_continuation_contract_is_refused() -> None:
    state = SegmentedRollout([[5], [6]], max_new_tokens=4, segment_tokens=2)
    with pytest.raises(EngineError, match="1 completions for 2 prefixes"):
        state.extend([0, 1], [_completion([7])], version=0, budget=2)
    with pytest.raises(EngineError, match=r"3 ids and 3 log-probs; expected .* at most 2 ids"):
        state.extend([0, 1], [_completion([7, 8, 9]), _completion([7])], version=0, budget=2)
    with pytest.raises(EngineError, match="for length after 1 of 2 ids"):
        state.extend([0, 1], [_completion([7]), _completion([7, 8])], version=0, budget=2)


def test_the_mailbox_keeps_the_newest_export_only() -> None:
    mailbox = WeightMailbox()
    assert mailbox.newer_than(0) is None
    mailbox.post(2, ["ref2"])
    mailbox.post(1, ["ref1"])  # an older post never replaces a newer one
    assert mailbox.newer_than(1) == (2, ["ref2"]) and mailbox.newer_than(2) is None
    mailbox.clear()
    assert mailbox.newer_than(0) is None


def _worker(segment_tokens: int | None, **sampling: Any) -> Any:
    from hybridflow.workers.roles import RoleSpec
    from hybridflow.workers.rollout import RolloutWorker

    model = ModelSpec(config=preset_model_config("tiny-qwen2"), seed=3)
    spec = RoleSpec(role="actor", name="rollout", engine="fsdp", engine_config=TrainingEngineConfig(model=model),
                    rollout_engine="hf", rollout_config=RolloutEngineConfig(model=model),
                    sampling=SamplingParams(**sampling))
    worker = RolloutWorker(spec, partial_rollout_tokens=segment_tokens)
    worker.synced = True  # the engine's own random init, version 0, stands for synced weights
    return worker


def _call(method: Any, *args: Any) -> Any:
    return getattr(method, "__wrapped__", method)(*args)


def test_greedy_segments_give_one_uninterrupted_generation() -> None:
    """Under one set of weights, 8 new tokens in segments of 3 (each continuing prompt + tokens so far, the engine's
    kept keys/values reused between them) are the tokens and log-probs of one generate call."""
    from hybridflow.workers.rollout import RolloutWorker

    greedy = {"n": 2, "temperature": 0.0, "max_new_tokens": 8, "seed": 0}
    segmented, whole = _worker(3, **greedy), _worker(None, **greedy)
    prompts = _prompts([[5, 6, 7], [8, 9], [10, 11, 12, 13]]).with_meta(policy_version=0)
    got = _call(RolloutWorker.generate, segmented, prompts)
    expected = _call(RolloutWorker.generate, whole, prompts)
    for column in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(got[column], expected[column]), column
    assert torch.allclose(got["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-5)
    mask = got["response_mask"].bool()
    assert int(mask.sum(dim=1).max()) > 3  # some row ran past its first segment
    assert (got[TOKEN_VERSIONS][mask] == 0).all() and (got[TOKEN_VERSIONS][~mask] == -1).all()
    assert got.meta["policy_version"] == 0 and list(got["uid"]) == list(expected["uid"])
    stats = segmented.rollout.kv_cache_stats
    assert stats["entries"] == 0 and stats["held_bytes"] == 0  # released after the call


def test_a_queued_load_of_weights_older_than_the_engines_loads_nothing() -> None:
    from hybridflow.workers.rollout import RolloutWorker, WeightsRef

    worker = _worker(2, n=1, max_new_tokens=4)
    worker.rollout._version = 3  # weights of version 3 held (loaded between the segments of a generation)
    report = _call(RolloutWorker.load_weights, worker, WeightsRef(ref=None), 2)
    assert report["superseded"] == 1.0 and report["bytes"] == 0 and worker.rollout.weights_version == 3


def test_an_engine_without_token_continuation_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridflow_fsdp.rollout as hf_rollout

    monkeypatch.setattr(hf_rollout, "CAPABILITIES", hf_rollout.CAPABILITIES - {"continue_from_tokens"})
    with pytest.raises(EngineError, match="needs a rollout engine with capability continue_from_tokens; rollout "
                                          "engine 'hf'"):
        _worker(2)
    _worker(None)  # without partial rollout the same engine is fine
