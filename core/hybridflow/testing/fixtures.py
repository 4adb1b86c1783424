"""Tiny real fixtures for tests: the character-level tokenizer and the tiny Qwen2/Llama presets with random init.

They are product code (:mod:`hybridflow.char_tokenizer`, :mod:`hybridflow.presets`), re-exported here for tests
and plugin contract suites; no model or data hub is touched.
"""

from __future__ import annotations

from hybridflow.char_tokenizer import BOS_ID, CHAR_VOCAB, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, build_char_tokenizer
from hybridflow.presets import save_tiny_model, tiny_model_config

__all__ = [
    "SPECIAL_TOKENS",
    "CHAR_VOCAB",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "build_char_tokenizer",
    "tiny_model_config",
    "save_tiny_model",
]
