"""``Runtime.sample_rows``: the readable samples of a step (``trainer.log_rollouts``) are rows spread over the batch,
decoded with the run's tokenizer, with their reward, length and mean response-token advantage; 0 keeps none."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch
from hybridflow.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from hybridflow.config import load_config


def scored_batch(tokenizer) -> Batch:  # type: ignore[no-untyped-def]
    """8 rows = 4 prompts × 2 samples; responses right-padded, the last token of row 1 masked out."""
    prompts = [f"{i}+{i}=" for i in range(4) for _ in range(2)]
    responses = [f"{2 * i}" if j == 0 else "x y" for i in range(4) for j in range(2)]
    prompt_ids = tokenizer(prompts, padding=True, return_tensors="pt").input_ids
    encoded = [tokenizer(text).input_ids + [EOS_ID] for text in responses]
    width = max(map(len, encoded))
    response_ids = torch.tensor([ids + [PAD_ID] * (width - len(ids)) for ids in encoded])
    response_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded])
    advantages = torch.arange(8, dtype=torch.float32).unsqueeze(1) * response_mask
    return Batch({"input_ids": torch.cat([prompt_ids, response_ids], 1),
                  "attention_mask": torch.cat([torch.ones_like(prompt_ids), response_mask], 1),
                  "responses": response_ids, "response_mask": response_mask,
                  "scores": torch.arange(8, dtype=torch.float32) / 10, "advantages": advantages},
                 {"uid": [f"p{i // 2}" for i in range(8)], "data_source": ["probe"] * 8,
                  "ground_truth": [str(2 * (i // 2)) for i in range(8)]})


def test_samples_spread_over_groups_and_decoded() -> None:
    tokenizer = build_char_tokenizer()
    runtime = Runtime(config=load_config(None, []), tokenizer=tokenizer, log_rollouts=4)
    batch = scored_batch(tokenizer)
    runtime.summarize(batch)
    assert [s["row"] for s in runtime.samples] == [0, 2, 4, 6]  # one per prompt group
    assert [s["uid"] for s in runtime.samples] == ["p0", "p1", "p2", "p3"]
    assert [s["prompt"] for s in runtime.samples] == ["0+0=", "1+1=", "2+2=", "3+3="]  # decoded from input ids
    assert [s["response"] for s in runtime.samples] == ["0", "2", "4", "6"]  # the eos token is not text
    assert [s["length"] for s in runtime.samples] == [2, 2, 2, 2]
    assert [s["reward"] for s in runtime.samples] == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert [s["advantage"] for s in runtime.samples] == [0.0, 2.0, 4.0, 6.0]  # mean over the response tokens
    batch["prompt_text"] = [f"text {i}" for i in range(8)]  # the dataset's own prompt text wins
    assert runtime.sample_rows(batch, 2)[1]["prompt"] == "text 4"
    assert [s["response"] for s in runtime.sample_rows(batch, 8)][1] == "x y"


def test_zero_keeps_no_samples() -> None:
    tokenizer = build_char_tokenizer()
    runtime = Runtime(config=load_config(None, []), tokenizer=tokenizer, log_rollouts=0)
    runtime.summarize(scored_batch(tokenizer))
    assert runtime.samples == []
