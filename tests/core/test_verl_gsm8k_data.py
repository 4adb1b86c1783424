"""The verl migration example's data: ``examples/verl_gsm8k/prepare.py`` writes verl-format parquet (chat-message
prompts, ``reward_model.ground_truth``, ``extra_info``) and a model directory with a locally trained BPE tokenizer and
chat template that the RL prompt loader renders as verl's layout expects."""

from __future__ import annotations

from pathlib import Path

from example_scripts import load_example_script
from hybridflow.data import PromptDataset, load_rows
from hybridflow.model_dir import load_tokenizer


def test_prepared_parquet_has_verl_columns_and_renders_through_the_chat_template(tmp_path: Path) -> None:
    prepare = load_example_script("verl_gsm8k/prepare.py").prepare
    out = prepare(tmp_path / "job", num_train=32, num_test=8, vocab_size=300)
    rows = load_rows(out / "data" / "train.parquet")
    assert set(rows[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["reward_model"]["style"] == "rule"
    assert rows[0]["extra_info"]["answer"].endswith(f"#### {rows[0]['reward_model']['ground_truth']}")
    tokenizer = load_tokenizer(out / "model")
    dataset = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=128, source="train.parquet")
    assert dataset.prompt_texts[0].startswith("<|im_start|>user\n") and dataset.prompt_texts[0].endswith(
        "<|im_start|>assistant\n")
    assert dataset.ground_truths[0] == rows[0]["reward_model"]["ground_truth"]
    assert dataset.extra_infos[0]["index"] == 0
    # the text survives the BPE round trip (byte-level: no normalisation)
    ids = tokenizer(dataset.prompt_texts[3], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == dataset.prompt_texts[3]
