"""``hybridflow rm``'s inputs and loss, without training: the Bradley-Terry loss against its formula, the pairwise
metrics, the synthetic task's hidden rule, and every bad input refused with an error naming what was expected, what
was found and the key to change."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridflow.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from hybridflow.errors import ConfigError, DatasetError
from hybridflow.tasks.preference import even_digit_share, make_preference_rows
from hybridflow.trainer.rm_config import load_rm_config
from hybridflow.trainer.rm_data import build_pair_batch, load_preference_pairs
from hybridflow.trainer.rm_loss import bradley_terry_loss, pairwise_metrics

ROOT = Path(__file__).resolve().parents[3]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# --- the loss and metrics ------------------------------------------------------------------------------------------
def test_bradley_terry_loss_is_the_formula_with_margin_and_centering() -> None:
    chosen, rejected = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([0.0, 0.25, 1.0])
    by_hand = -sum(math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(by_hand, rel=1e-6)
    margin = torch.tensor([1.0, -0.5, 0.0])
    with_margin = -sum(math.log(1 / (1 + math.exp(-(c - r - m)))) for c, r, m in
                       zip(chosen.tolist(), rejected.tolist(), margin.tolist())) / 3
    assert bradley_terry_loss(chosen, rejected, margin=margin).item() == pytest.approx(with_margin, rel=1e-6)
    centered = by_hand + 0.1 * ((2.0 ** 2) + (0.75 ** 2) + 0.0) / 3
    assert bradley_terry_loss(chosen, rejected, center_rewards_coefficient=0.1).item() == pytest.approx(centered,
                                                                                                      rel=1e-6)
    # its gradient raises the chosen reward and lowers the rejected one
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    bradley_terry_loss(c, r).backward()
    assert bool((c.grad < 0).all()) and bool((r.grad > 0).all())
    with pytest.raises(ValueError, match=r"must both be \[N\]"):
        bradley_terry_loss(chosen, rejected[:2])


def test_pairwise_metrics_count_wins_and_ties() -> None:
    metrics = pairwise_metrics(torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 3.0, 1.0]))
    assert metrics["accuracy"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert metrics["margin"] == pytest.approx((1 + 0 - 1 + 2) / 4)
    assert metrics["chosen_reward"] == pytest.approx(1.5) and metrics["rejected_reward"] == pytest.approx(1.0)


# --- the synthetic task --------------------------------------------------------------------------------------------
def test_preference_rows_follow_the_hidden_rule_and_hold_out_the_val_prompts() -> None:
    assert [even_digit_share(text) for text in ("8", "14", "7", "", "20 ")] == [1.0, 0.5, 0.0, 0.0, 1.0]
    train, val = make_preference_rows()
    assert (len(train), len(val)) == (80 * 4, 20 * 8)
    for row in train + val:
        assert even_digit_share(row["chosen"]) > even_digit_share(row["rejected"])
        assert row["margin"] == even_digit_share(row["chosen"]) - even_digit_share(row["rejected"])
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in val}
    # the shipped files are these rows
    shipped = (ROOT / "examples" / "data" / "arithmetic_pref_val.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in shipped] == val


# --- reading and laying out pairs ----------------------------------------------------------------------------------
def test_pairs_are_laid_out_as_a_rollout_with_the_same_prompt_on_both_sides(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "p.jsonl", [{"prompt": "1+2=", "chosen": "2", "rejected": "13", "margin": 0.5}])
    pairs = load_preference_pairs([file], margin_key="margin")
    batch = build_pair_batch(pairs, build_char_tokenizer(), max_prompt_length=6, max_response_length=4)
    tokenizer = build_char_tokenizer()
    assert batch.chosen["prompts"].tolist() == batch.rejected["prompts"].tolist() == [
        [PAD_ID, PAD_ID, *tokenizer("1+2=", add_special_tokens=False)["input_ids"]]]
    assert batch.chosen["responses"].tolist() == [[tokenizer.convert_tokens_to_ids("2"), EOS_ID, PAD_ID, PAD_ID]]
    assert batch.rejected["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 0]]
    assert batch.margin.tolist() == [0.5]


def test_implicit_prompt_is_the_common_prefix(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "p.jsonl", [{"chosen": "3+4=8", "rejected": "3+4=7"}])
    (pair,) = load_preference_pairs([file], prompt_key=None)
    assert (pair.prompt, pair.chosen, pair.rejected) == ("3+4=", "8", "7")


@pytest.mark.parametrize(("rows", "keys", "message"), [
    ([{"prompt": "1+1=", "good": "2", "rejected": "3"}], {},
     r"lacks column\(s\) 'chosen' \(data.chosen_key='chosen'\); found \['good', 'prompt', 'rejected'\]"),
    ([{"question": "1+1=", "chosen": "2", "rejected": "3"}], {},
     r"lacks column\(s\) 'prompt' \(data.prompt_key='prompt'\).*set those keys to your columns' names"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}], {"margin_key": "margin"},
     r"lacks column\(s\) 'margin' \(data.margin_key='margin'\).*loss.use_margin=false"),
    ([{"prompt": "1+1=", "chosen": "", "rejected": "3"}], {}, r"column 'chosen' is empty"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "2"}], {}, r"are the same text"),
    ([{"prompt": "1+1=", "chosen": ["2"], "rejected": "3"}], {}, r"'chosen' must be the response text, got list"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"}], {"margin_key": "margin"},
     r"'margin' \(data.margin_key\) must be a number, got str"),
    ([{"chosen": "2", "rejected": "3"}], {"prompt_key": None}, r"share no prefix"),
])
def test_bad_pairs_are_refused_naming_the_row_and_the_fix(tmp_path: Path, rows: list[dict], keys: dict,
                                                          message: str) -> None:
    file = write_rows(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DatasetError, match=message) as caught:
        load_preference_pairs([file], **keys)
    assert f"{file} row 0" in str(caught.value)


def test_empty_or_missing_files_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match=r"empty.jsonl has no pairs \(it is empty\).*'chosen' and 'rejected'"):
        load_preference_pairs([str(empty)])
    with pytest.raises(DatasetError, match=r"does not exist; check data.train_files"):
        load_preference_pairs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(DatasetError, match=r"no preference files given; set data.train_files"):
        load_preference_pairs([])


def test_a_response_longer_than_the_limit_names_the_side_and_the_key(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "12345"}])
    with pytest.raises(DatasetError, match=r"row 0: rejected '12345' has 6 tokens .* data.max_response_length=4"):
        build_pair_batch(load_preference_pairs([file]), build_char_tokenizer(), max_prompt_length=8,
                         max_response_length=4)


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train_files"):
        load_rm_config(None, ["data.val_files=[a.jsonl]"])
    with pytest.raises(ConfigError, match="center_rewards_coefficient"):
        load_rm_config(None, ["data.train_files=[a.jsonl]", "loss.center_rewards_coefficient=-1"])
    with pytest.raises(ConfigError, match="chosen_column"):
        load_rm_config(None, ["data.train_files=[a.jsonl]", "data.chosen_column=x"])
