"""The character-level tokenizer of the model presets: 45 tokens (digits, ``+ - * =``, space, a–z, 4 specials),
built locally as a Hugging Face ``PreTrainedTokenizerFast`` (no hub access). Stability: public.

It needs ``transformers`` and ``tokenizers`` (installed with the FSDP plugin); the models it pairs with are
:mod:`hybridflow.presets`'.
"""

from __future__ import annotations

import string
from typing import Any

__all__ = ["SPECIAL_TOKENS", "CHAR_VOCAB", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID", "build_char_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(string.digits) + ("+", "-", "*", "=", " ") + tuple(
    string.ascii_lowercase
)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_char_tokenizer() -> Any:
    """A 45-token character-level ``PreTrainedTokenizerFast`` (digits, + - * =, space, a–z, 4 specials)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(CHAR_VOCAB)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", ignore_merges=True))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated __init__ in transformers
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tokenizer
