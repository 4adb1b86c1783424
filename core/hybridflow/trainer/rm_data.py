"""Preference pairs for ``hybridflow rm``: reading them (TRL's ``prompt``/``chosen``/``rejected`` columns, named by
OpenRLHF's ``prompt_key``/``chosen_key``/``rejected_key``; TRL's optional ``margin``) and laying each side out as
the engines' teacher-forcing batch, so that a reward model scores them exactly as it scores a rollout (left-padded
prompt, then the response and its EOS; the score read at the last attended token). Training on them is
:mod:`hybridflow.trainer.rm`'s. Stability: experimental.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.columns import build_teacher_forcing_batch, check_demonstration_fits
from hybridflow.errors import ConfigError, DatasetError

__all__ = ["PreferencePair", "PairBatch", "load_preference_pairs", "build_pair_batch"]


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """One row: the prompt (text or chat messages), the chosen and the rejected response text, the margin (0.0
    unless the loss reads one) and where it came from (for errors)."""

    prompt: Any
    chosen: str
    rejected: str
    margin: float
    where: str


@dataclass(frozen=True, slots=True)
class PairBatch:
    """The pairs as two teacher-forcing batches of the same rows (``chosen[i]`` and ``rejected[i]`` are pair i)
    and their margins [N]."""

    chosen: Batch
    rejected: Batch
    margin: torch.Tensor

    def __len__(self) -> int:
        return len(self.chosen)

    def index(self, rows: torch.Tensor) -> PairBatch:
        return PairBatch(self.chosen.index(rows), self.rejected.index(rows), self.margin[rows])


def _split_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """TRL's implicit prompt: the longest common prefix of the two texts is the prompt, the rest the responses."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def load_preference_pairs(files: Sequence[str], *, prompt_key: str | None = "prompt", chosen_key: str = "chosen",
                          rejected_key: str = "rejected", margin_key: str | None = None) -> list[PreferencePair]:
    """The pairs of ``files`` (jsonl/parquet), each checked: the columns are present, chosen and rejected are
    non-empty text that differ, the margin (when ``margin_key`` is given) is a number. Every problem raises a
    :class:`DatasetError` naming the file, the row, what was expected and found, and the key to change."""
    from hybridflow.data import load_rows

    if not files:
        raise DatasetError("no preference files given; set data.train_files (jsonl/parquet with chosen and rejected "
                           "columns, e.g. examples/data/arithmetic_pref.jsonl)")
    keys = {"chosen": ("data.chosen_key", chosen_key), "rejected": ("data.rejected_key", rejected_key)}
    if prompt_key is not None:
        keys["prompt"] = ("data.prompt_key", prompt_key)
    if margin_key is not None:
        keys["margin"] = ("data.margin_key", margin_key)
    pairs: list[PreferencePair] = []
    for file in files:
        path = Path(file)
        if not path.exists():
            raise DatasetError(f"preference file {file} does not exist; check data.train_files / data.val_files (the "
                               "shipped pairs are made by `python -m hybridflow.tasks.preference`)")
        if path.suffix == ".jsonl" and not path.read_text(encoding="utf-8", errors="replace").strip():
            raise DatasetError(f"preference file {file} has no pairs (it is empty); a reward model needs rows with "
                               f"{chosen_key!r} and {rejected_key!r} columns")
        for index, row in enumerate(load_rows(file)):
            where = f"{file} row {index}"
            missing = [f"{column!r} ({key}={column!r})" for key, column in keys.values() if column not in row]
            if missing:
                raise DatasetError(
                    f"{where} lacks column(s) {', '.join(missing)}; found {sorted(row)}. A preference pair needs "
                    "the chosen and the rejected response (TRL's `chosen`/`rejected`, and `prompt` unless "
                    "data.prompt_key is null); set those keys to your columns' names"
                    + (" or loss.use_margin=false" if margin_key is not None else ""))
            chosen, rejected = row[chosen_key], row[rejected_key]
            for column, value in ((chosen_key, chosen), (rejected_key, rejected)):
                if not isinstance(value, str):
                    raise DatasetError(f"{where}: column {column!r} must be the response text, got "
                                       f"{type(value).__name__} ({value!r:.60}); chat-format responses are not "
                                       "supported: render them to text first")
            prompt: Any
            if prompt_key is None:
                prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected)
                if not prompt:
                    raise DatasetError(f"{where}: data.prompt_key is null (implicit prompt) but {chosen_key!r} and "
                                       f"{rejected_key!r} share no prefix to take as the prompt; add a prompt "
                                       "column and set data.prompt_key")
            else:
                prompt = row[prompt_key]
            for column, value in ((chosen_key, chosen), (rejected_key, rejected)):
                if not value.strip():
                    raise DatasetError(f"{where}: column {column!r} is empty; every pair needs two non-empty "
                                       "responses (drop the row)")
            if chosen == rejected:
                raise DatasetError(f"{where}: {chosen_key!r} and {rejected_key!r} are the same text ({chosen!r:.60}); "
                                   "such a pair teaches the reward model nothing; drop it")
            margin = 0.0
            if margin_key is not None:
                value = row[margin_key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise DatasetError(f"{where}: column {margin_key!r} (data.margin_key) must be a number, got "
                                       f"{type(value).__name__} ({value!r:.60})")
                margin = float(value)
            pairs.append(PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, margin=margin, where=where))
    if not pairs:
        raise DatasetError(f"no preference pairs in {', '.join(files)}; a reward model needs rows with "
                           f"{chosen_key!r} and {rejected_key!r} columns")
    return pairs


def build_pair_batch(pairs: Sequence[PreferencePair], tokenizer: Any, *, max_prompt_length: int,
                     max_response_length: int) -> PairBatch:
    """Both sides of ``pairs`` in the layout a rollout has (``prompts`` left-padded, ``responses`` = the response's
    tokens then EOS, right-padded, ``input_ids``/``attention_mask`` of both), the same prompt tokens on each side."""
    from hybridflow.data import render_prompt

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ConfigError("the tokenizer has no eos token; a reward model scores a response at its EOS, as a policy "
                          "writes it; use a tokenizer with one")
    sides: dict[str, list[tuple[list[int], list[int], list[int]]]] = {"chosen": [], "rejected": []}
    for pair in pairs:
        prompt_text = render_prompt(pair.prompt, tokenizer, where=pair.where)
        prompt = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
        if not prompt:
            raise DatasetError(f"{pair.where}: the prompt is empty after tokenisation")
        for side, text in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            response = [*tokenizer(text, add_special_tokens=False)["input_ids"], eos_id]
            check_demonstration_fits(prompt, response, max_prompt_length=max_prompt_length,
                                     max_response_length=max_response_length, where=pair.where,
                                     prompt_label=f"prompt {prompt_text!r}", response_label=f"{side} {text!r}")
            sides[side].append((prompt, response, [1] * len(response)))
    chosen, rejected = (build_teacher_forcing_batch(sides[side], max_prompt_length=max_prompt_length,
                                                    max_response_length=max_response_length, pad_token_id=pad_id)
                        for side in ("chosen", "rejected"))
    return PairBatch(chosen, rejected, torch.tensor([pair.margin for pair in pairs], dtype=torch.float32))
