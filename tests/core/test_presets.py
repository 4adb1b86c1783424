from __future__ import annotations

import typing

import pytest

from hybridflow.char_tokenizer import CHAR_VOCAB, EOS_ID, PAD_ID, build_char_tokenizer
from hybridflow.config import ModelConfig
from hybridflow.errors import ConfigError
from hybridflow.presets import MODEL_PRESETS, preset_model_config
from hybridflow.trainer.build import build_model_spec


def test_every_preset_the_config_accepts_builds() -> None:
    accepted = typing.get_args(typing.get_args(ModelConfig.model_fields["preset"].annotation)[0])
    assert sorted(accepted) == sorted(MODEL_PRESETS)
    for name in accepted:
        spec = build_model_spec(ModelConfig(preset=name), seed=3)
        assert spec.config is not None and spec.config["vocab_size"] >= len(CHAR_VOCAB)
        # every preset covers the character vocabulary; only tiny-qwen2-4h pads it (to 48, for tg = 2)
        assert spec.config["vocab_size"] == (48 if name == "tiny-qwen2-4h" else len(CHAR_VOCAB))
    assert preset_model_config("tiny-qwen2-h16")["num_attention_heads"] == 4
    assert preset_model_config("tiny-llama")["model_type"] == "llama"


def test_unknown_preset_is_refused_listing_the_known() -> None:
    with pytest.raises(ConfigError, match="tiny-qwen2, tiny-qwen2-h16, tiny-llama"):
        preset_model_config("tiny-gpt")


def test_char_tokenizer_round_trips_and_pads_with_the_preset_ids() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer("12+3=15")["input_ids"]
    assert tokenizer.decode(ids) == "12+3=15"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (PAD_ID, EOS_ID)
