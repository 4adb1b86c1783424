"""The synthetic preference task: pairs of answers to the arithmetic task's prompts, the chosen one preferred by a
hidden rule that the bench and the tests know and the models never see.

The hidden rule (the task's *true preference score*, :func:`even_digit_share`) is the share of even digits in the
answer: "8" (1.0) is preferred to "14" (0.5), which is preferred to "7" (0.0). It ignores whether the sum is right on
purpose: a policy fine-tuned on the sums (``hybridflow sft``) does not already maximise it, so PPO scored by a reward
model trained on these pairs (``hybridflow rm``) has something to raise, and how far it raised it is measured with
:func:`even_digit_reward` (never given to the reward model or the policy).

Rows are TRL's and OpenRLHF's preference layout: ``prompt``, ``chosen``, ``rejected``, plus ``margin`` (the true
scores' difference, read by the loss only when configured), ``data_source`` and ``extra_info``. The split is the SFT
demonstrations' (:func:`hybridflow.tasks.arithmetic.make_sft_rows`): pairs on held-out prompts are validation only.
Stability: experimental.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DATA_SOURCE", "PREF_FILE", "PREF_VAL_FILE", "even_digit_share", "even_digit_reward",
           "make_preference_rows", "write_preference_files"]

DATA_SOURCE = "hybridflow/arithmetic_preference"
#: the shipped preference pairs (examples/data/), made by :func:`write_preference_files`
PREF_FILE = "arithmetic_pref.jsonl"
PREF_VAL_FILE = "arithmetic_pref_val.jsonl"


def even_digit_share(response: str) -> float:
    """The true preference score: the share of even digits among the response's digits (0.0 without digits)."""
    digits = [character for character in response if character.isdigit()]
    if not digits:
        return 0.0
    return sum(int(digit) % 2 == 0 for digit in digits) / len(digits)


def even_digit_reward(*, responses: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str],
                      extra: Sequence[dict[str, Any]] | None = None) -> list[float]:
    """Reward-function form of :func:`even_digit_share` (``reward.function:
    hybridflow.tasks.preference:even_digit_reward``), for measuring a policy, not for training one."""
    return [even_digit_share(response) for response in responses]


def _pairs_for(prompt: str, answer: int, *, pairs: int, rng: random.Random) -> list[tuple[str, str, float]]:
    """``pairs`` distinct (chosen, rejected, margin) answers to ``prompt``: candidates near the true sum (what a
    policy answering sums writes), two of them with different true scores, the higher one chosen."""
    candidates = sorted({str(max(0, answer + delta)) for delta in range(-12, 13)})
    found: dict[tuple[str, str], float] = {}
    while len(found) < pairs:
        first, second = rng.sample(candidates, 2)
        gap = even_digit_share(first) - even_digit_share(second)
        if gap == 0:
            continue
        chosen, rejected = (first, second) if gap > 0 else (second, first)
        found.setdefault((chosen, rejected), abs(gap))
    return [(chosen, rejected, margin) for (chosen, rejected), margin in found.items()]


def make_preference_rows(*, pairs_per_prompt: int = 4, val_pairs_per_prompt: int = 8, seed: int = 0,
                         **task: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training pairs, held-out pairs): ``pairs_per_prompt`` pairs on each of the SFT demonstrations' training
    prompts and ``val_pairs_per_prompt`` on each held-out prompt (``task``: :func:`make_sft_rows`' arguments)."""
    from hybridflow.tasks.arithmetic import make_sft_rows

    rng = random.Random(seed)
    splits = []
    for rows, count in zip(make_sft_rows(**task), (pairs_per_prompt, val_pairs_per_prompt)):
        out: list[dict[str, Any]] = []
        for row in rows:
            for chosen, rejected, margin in _pairs_for(row["prompt"], int(row["response"]), pairs=count, rng=rng):
                out.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected, "margin": margin,
                            "data_source": DATA_SOURCE, "extra_info": {"index": len(out)}})
        splits.append(out)
    return splits[0], splits[1]


def write_preference_files(directory: str | Path, **options: Any) -> tuple[Path, Path]:
    """Write :func:`make_preference_rows` as ``arithmetic_pref.jsonl`` and ``arithmetic_pref_val.jsonl`` in
    ``directory`` (deterministic: the same bytes every time); returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in zip((PREF_FILE, PREF_VAL_FILE), make_preference_rows(**options)):
        path = directory / name
        path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":  # python -m hybridflow.tasks.preference [DIR]: regenerate the shipped pairs
    import sys

    for written in write_preference_files(sys.argv[1] if len(sys.argv) > 1 else "examples/data"):
        print(written)
