"""Prompt datasets in verl's column layout (parquet or jsonl, or a synthetic task) and a resumable prompt loader.

Columns: ``prompt`` (text, or chat messages ``[{"role": ..., "content": ...}]``), ``data_source``,
``reward_model.ground_truth`` (a dict column or a flattened ``reward_model.ground_truth`` column), optional
``extra_info`` (a dict per row, handed to reward functions). This module tokenises and batches prompts; generation
and scoring are other nodes' business.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.errors import DatasetError
from hybridflow.tasks.arithmetic import make_task_rows  # re-exported: the task split lives with the task

__all__ = ["PromptDataset", "PromptLoader", "load_rows", "render_prompt", "make_task_rows"]

REQUIRED_COLUMNS = ("prompt",)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``.jsonl``/``.json`` or ``.parquet`` file into row dicts, with errors that name the file."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist; check data.train_files")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        elif suffix in {".jsonl", ".json"}:
            rows = []
            with path.open(encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg}); each line must be one "
                                           "JSON object") from exc
                    if not isinstance(row, dict):
                        raise DatasetError(f"{path}:{number}: expected a JSON object per line, got "
                                           f"{type(row).__name__}")
                    rows.append(row)
        else:
            raise DatasetError(f"dataset file {path} has suffix {suffix or '(none)'}; expected .parquet or .jsonl")
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); re-encode it as UTF-8"
        ) from exc
    except DatasetError:
        raise
    except Exception as exc:  # pyarrow raises many types for a broken file
        raise DatasetError(f"could not read {path}: {type(exc).__name__}: {exc}") from exc
    if not rows:
        raise DatasetError(f"dataset file {path} is empty; it needs at least one row with a `prompt` column")
    return rows


def render_prompt(prompt: Any, tokenizer: Any, *, where: str, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Text of a prompt given as text or as chat messages (chat template when the tokenizer has one; ``tools``, the
    function schemas of a multi-turn run's tools, are rendered by the template as verl's ``tools=`` does)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if getattr(tokenizer, "chat_template", None):
            return str(tokenizer.apply_chat_template(list(prompt), tools=list(tools) if tools else None,
                                                     tokenize=False, add_generation_prompt=True))
        return "".join(str(m["content"]) for m in prompt)
    raise DatasetError(f"{where}: `prompt` must be text or a list of {{role, content}} messages, got "
                       f"{type(prompt).__name__}")


def _ground_truth(row: dict[str, Any]) -> Any:
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict):
        return reward_model.get("ground_truth")
    return row.get("reward_model.ground_truth")


def _extra_info(row: dict[str, Any], where: str) -> dict[str, Any]:
    extra = row.get("extra_info")
    if extra is None:
        return {}
    if isinstance(extra, str):  # verl datasets written through pandas sometimes hold it as JSON text
        with contextlib.suppress(json.JSONDecodeError):
            extra = json.loads(extra)
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: `extra_info` must be a mapping (verl layout, e.g. {{\"index\": 0}}), got "
                           f"{type(extra).__name__}")
    return dict(extra)


@dataclass(frozen=True, slots=True)
class PromptDataset:
    """Tokenised prompts (left-padded to ``max_prompt_length``) with their reward metadata."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_texts: list[str]
    ground_truths: list[Any]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]]  # each row's ``extra_info`` ({} when absent), passed to reward functions
    #: each row's ``prompt`` as the file gives it (chat messages or text): verl's ``raw_prompt``, which agents as
    #: code (rollout.agent) receive as their sample's ``prompt``
    raw_prompts: list[Any] = field(default_factory=list)

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_prompt_length: int,
                  source: str = "dataset", tools: Sequence[Mapping[str, Any]] | None = None) -> PromptDataset:
        if not rows:
            raise DatasetError(f"{source} has no rows")
        missing = [c for c in REQUIRED_COLUMNS if c not in rows[0]]
        if missing:
            raise DatasetError(f"{source} lacks column(s) {missing}; found {sorted(rows[0])}. verl layout expected: "
                               "prompt, data_source, reward_model.ground_truth")
        texts, truths, sources, extras, ids, raws = [], [], [], [], [], []
        for index, row in enumerate(rows):
            where = f"{source} row {index}"
            if "prompt" not in row:
                raise DatasetError(f"{where} lacks the `prompt` column")
            text = render_prompt(row["prompt"], tokenizer, where=where, tools=tools)
            token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not token_ids:
                raise DatasetError(f"{where}: prompt is empty after tokenisation")
            if len(token_ids) > max_prompt_length:
                raise DatasetError(
                    f"{where}: prompt has {len(token_ids)} tokens, more than data.max_prompt_length="
                    f"{max_prompt_length}; raise the limit or filter long prompts out"
                )
            texts.append(text)
            raws.append(row["prompt"])
            truths.append(_ground_truth(row))
            sources.append(str(row.get("data_source", "unknown")))
            extra = _extra_info(row, where)
            if row.get("agent_name") is not None:  # verl's column choosing the agent loop (hybridflow.agent)
                extra["agent_name"] = str(row["agent_name"])
            extras.append(extra)
            ids.append(token_ids)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(ids), max_prompt_length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), max_prompt_length), dtype=torch.long)
        for row_index, token_ids in enumerate(ids):
            input_ids[row_index, max_prompt_length - len(token_ids):] = torch.tensor(token_ids)
            attention_mask[row_index, max_prompt_length - len(token_ids):] = 1
        return cls(input_ids, attention_mask, texts, truths, sources, extras, raws)

    def __len__(self) -> int:
        return len(self.prompt_texts)

    def batch(self, indices: Sequence[int], *, uids: Sequence[str]) -> Batch:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return Batch(
            {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx]},
            {
                "uid": list(uids),
                "prompt_text": [self.prompt_texts[i] for i in indices],
                "ground_truth": [self.ground_truths[i] for i in indices],
                "data_source": [self.data_sources[i] for i in indices],
                "extra_info": [self.extra_infos[i] for i in indices],
                **({"raw_prompt": [self.raw_prompts[i] for i in indices]} if self.raw_prompts else {}),
            },
        )


class PromptLoader:
    """Endless, seeded, resumable batches of prompts: epoch-wise shuffles, state = (epoch, position)."""

    def __init__(self, dataset: PromptDataset, *, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size > len(dataset):
            raise DatasetError(f"data.batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts); "
                               "lower the batch size or add prompts")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._cached_order: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._cached_order is not None and self._cached_order[0] == epoch:
            return self._cached_order[1]
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        self._cached_order = (epoch, order)
        return order

    def _next_place(self) -> tuple[int, int]:
        """(epoch, position) of the next batch."""
        if self.position + self.batch_size > len(self.dataset):
            return self.epoch + 1, 0
        return self.epoch, self.position

    def _batch_at(self, epoch: int, position: int) -> Batch:
        order = self._order(epoch)[position:position + self.batch_size]
        return self.dataset.batch(order, uids=[f"e{epoch}-p{index}" for index in order])

    def next_batch(self) -> Batch:
        self.epoch, self.position = self._next_place()
        batch = self._batch_at(self.epoch, self.position)
        self.position += self.batch_size
        return batch

    def peek(self) -> Batch:
        """The batch :meth:`next_batch` will return, without advancing."""
        return self._batch_at(*self._next_place())

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
