"""The verl migration example's data: ``examples/verl_gsm8k/prepare.py`` writes verl-format parquet (chat-message
prompts, ``reward_model.ground_truth``, ``extra_info``) and a model directory with a locally trained BPE tokenizer and
chat template; ``examples/grpo_verl_gsm8k.yaml`` trains GRPO on it with the example's verl-signature reward file,
taken as it is (its extra keys logged, validation named ``val-core/openai/gsm8k/...``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from hybridflow.data import PromptDataset, load_rows
from hybridflow.model_dir import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _prepare_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verl_gsm8k_prepare", ROOT / "examples" / "verl_gsm8k" / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepared_parquet_has_verl_columns_and_renders_through_the_chat_template(tmp_path: Path) -> None:
    out = _prepare_module().prepare(tmp_path / "job", num_train=32, num_test=8, vocab_size=300)
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
