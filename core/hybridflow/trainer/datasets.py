"""A run's prompts: the training dataset (``data.train_files`` or the built-in task's rows) and its validation."""

from __future__ import annotations

from typing import Any

from hybridflow.config import Config
from hybridflow.data import PromptDataset, load_rows, make_task_rows
from hybridflow.trainer.validation import Validation, build_validation

__all__ = ["load_datasets"]


def load_datasets(config: Config, tokenizer: Any) -> tuple[PromptDataset, Validation | None]:
    """The training prompts, and the validation (``data.val_files`` or the task's held-out prompts) if any."""
    data = config.data
    held_out: list[dict[str, Any]] = []
    if data.train_files:
        rows: list[dict[str, Any]] = []
        for file in data.train_files:
            rows.extend(load_rows(file))
        source = ", ".join(data.train_files)
    else:
        assert data.task is not None
        rows, held_out = make_task_rows(data.task)
        source = f"task {data.task.name}"
    from hybridflow.agent.worker import prompt_tool_schemas

    train = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=data.max_prompt_length, source=source,
                                    tools=prompt_tool_schemas(config))
    return train, build_validation(config, tokenizer, held_out)
