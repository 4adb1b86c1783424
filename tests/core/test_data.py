"""Prompt datasets in verl's layout: parquet and jsonl, text and chat prompts, resumable loader, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import PromptDataset, PromptLoader, load_rows
from hybridflow.errors import DatasetError, RewardError
from hybridflow.rewards import compute_rule_rewards, resolve_reward_function
from hybridflow.tasks.arithmetic import make_arithmetic_rows, score_arithmetic
from hybridflow.testing.fixtures import PAD_ID, build_char_tokenizer

ROWS = [
    {"prompt": "1+2=", "data_source": "toy", "reward_model": {"ground_truth": "3", "style": "rule"}},
    {"prompt": [{"role": "user", "content": "4+5="}], "data_source": "toy",
     "reward_model": {"ground_truth": "9", "style": "rule"}},
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_char_tokenizer()


def test_jsonl_and_parquet_give_the_same_left_padded_batch(tmp_path: Path, tokenizer) -> None:
    chat_rows = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str)
                  else row["prompt"]} for row in ROWS]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(chat_rows), parquet)
    a = PromptDataset.from_rows(load_rows(jsonl), tokenizer, max_prompt_length=6)
    b = PromptDataset.from_rows(load_rows(parquet), tokenizer, max_prompt_length=6)
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.input_ids[0].tolist()[:2] == [PAD_ID, PAD_ID] and a.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert a.prompt_texts == ["1+2=", "4+5="] and b.ground_truths == ["3", "9"] and b.data_sources == ["toy", "toy"]


def test_dataset_errors_name_the_file_and_the_fix(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match=r"empty\.jsonl is empty"):
        load_rows(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1="}\n{not json\n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl:2: not valid JSON"):
        load_rows(broken)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match="not UTF-8"):
        load_rows(latin)
    with pytest.raises(DatasetError, match="lacks column"):
        PromptDataset.from_rows([{"question": "1+1="}], tokenizer, max_prompt_length=8)
    with pytest.raises(DatasetError, match=r"more than data\.max_prompt_length=3"):
        PromptDataset.from_rows(ROWS, tokenizer, max_prompt_length=3)


def test_loader_is_seeded_and_resumable(tokenizer) -> None:
    dataset = PromptDataset.from_rows(make_arithmetic_rows(num_rows=20, seed=1), tokenizer, max_prompt_length=8)
    loader = PromptLoader(dataset, batch_size=6, seed=3)
    first = [loader.next_batch() for _ in range(2)]
    state = loader.state_dict()
    rest = [list(loader.next_batch()["uid"]) for _ in range(5)]
    resumed = PromptLoader(dataset, batch_size=6, seed=3)
    resumed.load_state_dict(state)
    assert [list(resumed.next_batch()["uid"]) for _ in range(5)] == rest
    uids = [u for b in first for u in b["uid"]]
    assert len(set(uids)) == 12  # no prompt twice within an epoch


def test_peek_returns_the_next_batch_without_advancing(tokenizer) -> None:
    dataset = PromptDataset.from_rows(make_arithmetic_rows(num_rows=20, seed=1), tokenizer, max_prompt_length=8)
    loader = PromptLoader(dataset, batch_size=6, seed=3)
    for _ in range(7):  # crosses two epoch boundaries (20 rows, batches of 6)
        state = loader.state_dict()
        peeked = loader.peek()
        assert loader.state_dict() == state
        batch = loader.next_batch()
        assert list(peeked["uid"]) == list(batch["uid"]) and torch.equal(peeked["input_ids"], batch["input_ids"])
    assert loader.state_dict()["epoch"] == 2


def test_rewards_checked_and_resolved() -> None:
    assert score_arithmetic("12<junk", "12") == 1.0 and score_arithmetic("1", "12") == 0.25
    fn = resolve_reward_function("arithmetic")
    rewards = compute_rule_rewards(fn, responses=["3", "x"], ground_truths=["3", "3"], data_sources=["a", "a"])
    assert rewards == [1.0, 0.0]
    with pytest.raises(RewardError, match="returned 1 scores for 2 responses"):
        compute_rule_rewards(lambda **k: [1.0], responses=["a", "b"], ground_truths=[0, 0], data_sources=["", ""])
    with pytest.raises(RewardError, match="non-finite"):
        compute_rule_rewards(lambda **k: [float("nan")], responses=["a"], ground_truths=[0], data_sources=[""])
    with pytest.raises(RewardError, match="raised ZeroDivisionError"):
        compute_rule_rewards(lambda **k: [1 / 0], responses=["a"], ground_truths=[0], data_sources=[""])
    assert resolve_reward_function("hybridflow.tasks.arithmetic:arithmetic_reward") is not None
    from hybridflow.errors import ConfigError

    with pytest.raises(ConfigError, match="could not import module"):
        resolve_reward_function("no_such_module_xyz:f")
