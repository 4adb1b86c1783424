"""The arithmetic task: prompts ``"a+b="`` and a rule-based reward (1.0 when the response starts with the exact
sum, partial credit for correct leading digits). It makes data and scores text; tokenising and batching are
:mod:`hybridflow.data`'s job.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["DATA_SOURCE", "make_arithmetic_rows", "extract_answer", "score_arithmetic", "arithmetic_reward"]

DATA_SOURCE = "hybridflow/arithmetic"
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
