"""The driver's response decoding: the backend fast path gives transformers' batch_decode text exactly, and a
tokenizer that cleans up spaces keeps the transformers path."""

from __future__ import annotations

import torch

from hybridflow.algorithms.helpers import decode_batch
from hybridflow.algorithms.runtime import Runtime
from hybridflow.batch import Batch
from hybridflow.testing.fixtures import EOS_ID, PAD_ID, build_char_tokenizer


def test_decode_batch_equals_transformers_batch_decode() -> None:
    tokenizer = build_char_tokenizer()
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, len(tokenizer), (32, 12), generator=generator).tolist()  # specials included
    expected = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    assert decode_batch(tokenizer, sequences) == expected
    assert any(text != "" for text in expected)


def test_decode_batch_keeps_transformers_clean_up() -> None:
    calls = []

    class CleaningTokenizer:
        clean_up_tokenization_spaces = True
        backend_tokenizer = build_char_tokenizer().backend_tokenizer

        def batch_decode(self, sequences, skip_special_tokens=False):
            calls.append(len(sequences))
            return ["cleaned"] * len(sequences)

    assert decode_batch(CleaningTokenizer(), [[5, 6]]) == ["cleaned"] and calls == [1]


def test_runtime_decodes_only_masked_response_tokens() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(list("12")) + [EOS_ID, PAD_ID]
    batch = Batch({"responses": torch.tensor([ids, ids]), "response_mask": torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])})
    runtime = Runtime(config=None, tokenizer=tokenizer)
    assert runtime.decode_responses(batch) == ["12", "1"]
