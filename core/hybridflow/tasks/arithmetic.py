"""The arithmetic task: prompts ``"a+b="`` and a rule-based reward (1.0 when the response starts with the exact
sum, partial credit for correct leading digits). It makes data and scores text; tokenising and batching are
:mod:`hybridflow.data`'s job.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.errors import DatasetError

__all__ = ["DATA_SOURCE", "make_arithmetic_rows", "make_task_rows", "extract_answer", "score_arithmetic",
           "arithmetic_reward", "arithmetic_exact_reward", "make_sft_rows", "write_sft_files", "SFT_FILE",
           "SFT_VAL_FILE"]

DATA_SOURCE = "hybridflow/arithmetic"
#: the demonstrations shipped for the warm start (examples/data/), made by :func:`write_sft_files`
SFT_FILE = "arithmetic_sft.jsonl"
SFT_VAL_FILE = "arithmetic_sft_val.jsonl"
PARTIAL_CREDIT = 0.5
_LEADING_INTEGER = re.compile(r"-?\d+")


def make_arithmetic_rows(
    *, num_rows: int, max_operand: int = 99, seed: int = 0, operators: str = "+"
) -> list[dict[str, Any]]:
    """Rows in verl's layout: ``prompt`` text, ``data_source``, ``reward_model.ground_truth``, ``extra_info``."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(operators)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({
            "prompt": f"{a}{op}{b}=",
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": index},
        })
    return rows


def extract_answer(response: str) -> str:
    """The integer the response starts with (after spaces), or "" — the answer-extraction rule of the task."""
    match = _LEADING_INTEGER.match(response.strip())
    return match.group(0) if match else ""


def score_arithmetic(response: str, ground_truth: str) -> float:
    """1.0 if the integer the response starts with is the answer; otherwise
    ``0.5 × (matching leading characters / answer length)``."""
    text = response.strip()
    if extract_answer(text) == ground_truth:
        return 1.0
    matched = 0
    for got, want in zip(text, ground_truth):
        if got != want:
            break
        matched += 1
    return PARTIAL_CREDIT * matched / len(ground_truth)


def arithmetic_reward(*, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                      extra: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """Registry-style reward function over a batch of decoded responses."""
    return [score_arithmetic(r, str(g)) for r, g in zip(responses, ground_truths)]


def arithmetic_exact_reward(*, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                            extra: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """Exact match of the whole response (1.0 when it is the sum and nothing else, spaces aside; else 0.0): the main
    job's reward once SFT has taught the format.

    Partial credit helps a policy that starts from random init find the answer's leading digit; from a warm start it
    rewards near misses ("13" for "12") and, measured on the main job, slowed the held-out accuracy's rise. Only the
    whole response counts because a reward that reads the leading integer lets a policy with an entropy bonus append
    random characters after the answer for free (measured: responses grew to the 8-token limit within 400 steps)."""
    return [1.0 if r.strip() == str(g).strip() else 0.0 for r, g in zip(responses, ground_truths)]


def make_task_rows(task: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training rows and held-out validation rows of the synthetic task ``task`` (a ``data.task`` section).

    Without ``num_val_prompts`` the training rows are the task's first ``num_prompts`` rows. With it, that many
    distinct prompts are drawn first (stream seed + 1) and the training rows are the task's stream with every one
    of them skipped: no validation prompt is ever trained on.
    """
    def draw(count: int, seed: int) -> list[dict[str, Any]]:
        return make_arithmetic_rows(num_rows=count, max_operand=task.max_operand, seed=seed, operators=task.operators)

    held_out = int(getattr(task, "num_val_prompts", 0) or 0)
    if not held_out:
        return draw(task.num_prompts, task.seed), []
    distinct = (task.max_operand + 1) ** 2 * len(set(task.operators))
    if held_out >= distinct:
        raise DatasetError(f"data.task.num_val_prompts={held_out} leaves no prompt to train on: the task has "
                           f"{distinct} distinct prompts (max_operand={task.max_operand}, operators "
                           f"{task.operators!r}); hold out fewer or raise data.task.max_operand")
    validation: dict[str, dict[str, Any]] = {}
    count = held_out
    while len(validation) < held_out:
        count *= 2
        for row in draw(count, task.seed + 1):
            validation.setdefault(row["prompt"], row)
            if len(validation) == held_out:
                break
    train: list[dict[str, Any]] = []
    count = task.num_prompts
    while len(train) < task.num_prompts:
        count *= 2
        train = [row for row in draw(count, task.seed) if row["prompt"] not in validation][: task.num_prompts]
    return train, list(validation.values())


def make_sft_rows(*, max_operand: int = 9, seed: int = 0, num_prompts: int = 1024, num_val_prompts: int = 20,
                  operators: str = "+") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Demonstrations for supervised fine-tuning: (training rows, validation rows), each ``{prompt, response,
    data_source, reward_model, extra_info}`` with the correct answer as the response.

    The split is the RL task's (``data.task`` with the same arguments, :func:`make_task_rows`):
    the training rows are its distinct training prompts in order of first appearance, so no held-out validation
    prompt is ever among them; the validation rows are its held-out prompts (for ``val/loss`` and greedy accuracy).
    """
    from types import SimpleNamespace

    task = SimpleNamespace(max_operand=max_operand, seed=seed, num_prompts=num_prompts,
                           num_val_prompts=num_val_prompts, operators=operators)
    train, held_out = make_task_rows(task)
    distinct: dict[str, dict[str, Any]] = {}
    for row in train:
        distinct.setdefault(row["prompt"], row)

    def demonstration(row: dict[str, Any], index: int) -> dict[str, Any]:
        answer = row["reward_model"]["ground_truth"]
        return {"prompt": row["prompt"], "response": answer, "data_source": row["data_source"],
                "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"index": index}}

    return ([demonstration(row, i) for i, row in enumerate(distinct.values())],
            [demonstration(row, i) for i, row in enumerate(held_out)])


def write_sft_files(directory: str | Path, **task: Any) -> tuple[Path, Path]:
    """Write :func:`make_sft_rows` as ``arithmetic_sft.jsonl`` and ``arithmetic_sft_val.jsonl`` in ``directory``
    (deterministic: the same bytes every time); returns both paths."""
    import json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip((SFT_FILE, SFT_VAL_FILE), make_sft_rows(**task)):
        path = directory / name
        path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":  # python -m hybridflow.tasks.arithmetic [DIR]: regenerate the shipped demonstrations
    import sys

    for written in write_sft_files(sys.argv[1] if len(sys.argv) > 1 else "examples/data"):
        print(written)
