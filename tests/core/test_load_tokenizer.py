"""Tokenizers come back from an HF directory as the directory declares them: transformers 5's AutoTokenizer picks the
class from the model type (qwen2 → Qwen2Tokenizer, which drops the spaces the character tokenizer keeps)."""

from __future__ import annotations

from pathlib import Path

from hybridflow.config import ModelConfig
from hybridflow.model_dir import load_tokenizer
from hybridflow.presets import save_tiny_model
from hybridflow.trainer.build import build_tokenizer


def test_a_saved_character_tokenizer_round_trips_spaces(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = save_tiny_model(tmp_path / "model")
    text = "12 + 7 = 19"
    tokenizer = build_tokenizer(ModelConfig(path=str(path)))
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert load_tokenizer(path).get_vocab() == tokenizer.get_vocab()
    # what the loader guards against (if transformers stops doing this, the special case can go)
    auto = AutoTokenizer.from_pretrained(str(path))
    assert auto.decode(auto(text)["input_ids"]) != text


def test_a_saved_chat_tokenizer_keeps_its_template(tmp_path: Path) -> None:
    from hybridflow.testing.chat_tokenizer import save_tiny_chat_model

    path = save_tiny_chat_model(tmp_path / "chat")
    tokenizer = load_tokenizer(path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "3*4"}], tokenize=False,
                                             add_generation_prompt=True)
    assert "3*4" in rendered and rendered != "3*4"


def test_a_missing_model_directory_is_a_config_error_saying_how_to_make_it(tmp_path: Path) -> None:
    import pytest

    from hybridflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.path 'runs/nowhere/hf' is not a directory.*hybridflow sft"):
        build_tokenizer(ModelConfig(path="runs/nowhere/hf"))
    with pytest.raises(ConfigError, match=r"no tokenizer could be loaded from it"):
        build_tokenizer(ModelConfig(path=str(tmp_path)))  # a directory, but no model in it
