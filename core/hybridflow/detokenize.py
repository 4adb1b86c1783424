"""Token ids back to text, as reward functions, judges and validation read responses (no package of hybridflow
imported: workers and algorithms both use it)."""

from __future__ import annotations

from typing import Any

__all__ = ["decode_batch"]


def decode_batch(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=True)``; for a fast tokenizer without clean-up, the
    same text straight from its ``backend_tokenizer`` (skipping transformers' per-element input conversion, which
    costs more than the decoding)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch") and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True):
        return list(backend.decode_batch(sequences, skip_special_tokens=True))
    return list(tokenizer.batch_decode(sequences, skip_special_tokens=True))
