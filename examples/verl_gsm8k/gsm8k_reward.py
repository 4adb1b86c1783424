"""A reward file in verl's custom-reward form (``custom_reward_function.path`` / ``.name``): per sample,
``compute_score(data_source, solution_str, ground_truth, extra_info=None)``. hybridflow takes it unchanged
(``reward.function: verl_gsm8k/gsm8k_reward.py:compute_score``).

The rule is GSM8K's strict format: the number after the last ``####`` must equal the ground truth (1.0); an answer
with ``####`` but a wrong number earns the format score (0.1); anything else 0. The extra keys are logged.
"""

from __future__ import annotations

import re
from typing import Any

_FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, float]:
    matches = _FINAL.findall(solution_str)
    answer = matches[-1].replace(",", "") if matches else None
    correct = answer is not None and answer == str(ground_truth).replace(",", "")
    score = 1.0 if correct else (0.1 if answer is not None else 0.0)
    return {"score": score, "acc": float(correct), "formatted": float(answer is not None)}
