"""A generative reward model on the trainer's path: a tiny judge trained here by the project's own SFT path
(:class:`~hybridflow.trainer.sft.SFTTrainer`) to grade the shipped arithmetic task scores a GRPO run from random
init through ``reward.genrm`` (the ``hf`` rollout engine, colocated with the actor), and the run's task score rises;
the same judge with its verdict inverted (a ``file.py:function`` parser, on a pool of its own) does not raise it.

The judge reads ``"{ground_truth:<2}={response}="`` and answers ``y`` when the response starts with the sum's first
digit, ``n`` otherwise (read by the default ``verdict`` parser as 1 / 0): the first step of the task's own partial
credit. The task score is measured apart from the judge: every sampled response of every step is logged
(``trainer.log_rollouts``) and scored by the task's rule (:func:`~hybridflow.tasks.arithmetic.score_arithmetic`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from statistics import mean
from typing import Any

import pytest

from hybridflow.char_tokenizer import CHAR_VOCAB
from hybridflow.tasks.arithmetic import make_arithmetic_rows, score_arithmetic
from hybridflow.trainer.cli import fit_and_close
from hybridflow.trainer.progress import read_metrics
from hybridflow.trainer.rollouts import read_rollouts

#: the sum left-aligned in two characters, so its digits and the response's first ones sit at fixed positions
TEMPLATE = "{ground_truth:<2}={response}="
#: steps of each GRPO run, and how many at each end the task score is averaged over
STEPS, WINDOW = 40, 10
#: the task score of the last WINDOW steps must beat the first WINDOW's by this much (see the tests' docstrings)
MARGIN = 0.05
_CHARACTERS = [c for c in CHAR_VOCAB[4:]]


def grade(response: str, ground_truth: str) -> str:
    """The verdict the judge is taught: "y" when the response starts with the sum's first digit, else "n"."""
    return "y" if response.strip()[:1] == ground_truth[:1] else "n"


def _judge_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Demonstrations for the judge: task prompts with, in turn, a response that starts like the answer (the
    answer itself, maybe followed by more characters), one that starts with another digit, and random text (what a
    policy from random init writes). The wrong-digit third makes the judge compare digits instead of rewarding any
    digit (a judge trained without it gave "digit first" responses its best grade, and GRPO learned exactly that)."""
    rng = random.Random(seed)

    def text(length: int) -> str:
        return "".join(rng.choice(_CHARACTERS) for _ in range(length))

    rows = []
    for index, row in enumerate(make_arithmetic_rows(num_rows=count, max_operand=9, seed=seed)):
        truth = row["reward_model"]["ground_truth"]
        kind = index % 3
        if kind == 0:
            response = rng.choice([truth, truth[0]]) + text(rng.randint(0, 6))
        elif kind == 1:
            response = rng.choice([d for d in "0123456789" if d != truth[0]]) + text(rng.randint(0, 7))
        else:
            response = text(rng.randint(1, 8))
        response = response[:8]
        rows.append({"prompt": TEMPLATE.format(response=response.strip(), ground_truth=truth),
                     "response": grade(response, truth), "data_source": "judge"})
    return rows


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A judge SFT-trained by ``hybridflow sft``'s trainer (tiny-qwen2 preset, 150 steps of 64 demonstrations,
    cosine-decayed learning rate); its greedy verdicts on 192 held-out demonstrations must be at least 75% right
    (from 0 before training; measured 0.82 at this seed)."""
    from hybridflow.trainer.sft import SFTTrainer, load_sft_config

    root = tmp_path_factory.mktemp("genrm")
    for name, rows in (("train.jsonl", _judge_rows(3000, seed=1)), ("val.jsonl", _judge_rows(192, seed=2))):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    trainer = SFTTrainer(load_sft_config(None, [
        f"data.train_files=[{root / 'train.jsonl'}]", f"data.val_files=[{root / 'val.jsonl'}]",
        "data.max_prompt_length=12", "data.max_response_length=2", "data.batch_size=64", "actor.micro_batch_size=64",
        "actor.optim.lr=0.003", "actor.optim.warmup_steps=5", "actor.optim.schedule=cosine",
        "actor.optim.min_lr_ratio=0.1", "reward.function=arithmetic_exact", "trainer.total_steps=150",
        "trainer.val_every=0", f"trainer.run_dir={root / 'sft'}",
        "trainer.progress=false", "trainer.tensorboard=false"]), progress=False)
    target = fit_and_close(trainer)
    accuracy = trainer.validation_history[-1]["val-core/judge/acc/mean@1"]
    assert accuracy >= 0.75, trainer.validation_history
    return target


def _grpo(tmp_path: Path, tiny_config: Any, judge: Path, *overrides: str) -> tuple[list[float], list[dict[str, Any]],
                                                                                     list[dict[str, float]]]:
    """A GRPO run from random init scored by the judge alone: the task score per step (the rule on every logged
    response), the logged rollouts and the metrics."""
    from hybridflow.trainer import Trainer

    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=0",
                         "trainer.log_rollouts=64", f"reward.genrm.model.path={judge}",
                         f'reward.genrm.template="{TEMPLATE}"', "reward.genrm.rollout.prompt_length=12",
                         "reward.genrm.rollout.response_length=2", *overrides)
    assert config.reward.function is None  # the judge alone scores the run
    fit_and_close(Trainer(config, progress=False))
    rollouts = read_rollouts(run_dir)
    by_step: dict[int, list[float]] = {}
    for row in rollouts:
        by_step.setdefault(int(row["step"]), []).append(score_arithmetic(row["response"], str(row["ground_truth"])))
    assert sorted(by_step) == list(range(STEPS)) and all(len(scores) == 64 for scores in by_step.values())
    return [mean(by_step[step]) for step in range(STEPS)], rollouts, read_metrics(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_scored_by_an_sft_trained_judge_raises_the_task_score(tmp_path: Path, tiny_config: Any,
                                                                   judge_dir: Path) -> None:
    """The judge, colocated with the actor on pool ``main``, is the run's only reward: the task score of the last
    10 of 40 steps beats the first 10's by ``MARGIN``, and its verdicts agree with the taught grade on most
    responses. Measured (seed 0, 2-core box): judge accuracy 0.90; task score 0.011 → 0.127; agreement 0.89. The
    inverted judge of the next test: 0.014 → 0.007."""
    task, rollouts, metrics = _grpo(tmp_path, tiny_config, judge_dir)
    first, last = mean(task[:WINDOW]), mean(task[-WINDOW:])
    assert last > first + MARGIN, (first, last, task)
    agree = [row["reward"] == (grade(row["response"], str(row["ground_truth"])) == "y") for row in rollouts]
    assert mean(agree) >= 0.8, mean(agree)
    # counted on every step; a verdict that does not parse is rare (measured: 7 of 2,560) and only fails its sample
    assert all("reward/genrm_parse_failures" in row and "reward/genrm_failed_ratio" in row for row in metrics)
    assert sum(row["reward/genrm_failed"] for row in metrics) <= 0.01 * 64 * STEPS
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["mapping"]["genrm"]["pool"] == "main" and manifest["mapping"]["genrm"]["engine"] == "hf"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_inverted_judge_does_not_raise_the_task_score(tmp_path: Path, tiny_config: Any, judge_dir: Path) -> None:
    """The same judge with its verdict inverted (1 − verdict, a parser file) on a pool of its own: the run learns the
    judge's preference, not the task, and the margin the right judge clears is not met."""
    parser = tmp_path / "inverted.py"
    parser.write_text("from hybridflow.genrm import parse_verdict\n\n\ndef parse(text):\n"
                      "    verdict = parse_verdict(text)\n    return None if verdict is None else 1.0 - verdict\n")
    task, rollouts, _ = _grpo(tmp_path, tiny_config, judge_dir, f"reward.genrm.parser={parser}:parse",
                                    "reward.genrm.pool=judge",
                                    "resource_pools.judge={devices_per_node: [1], device: cpu, cpus_per_worker: 0.5}")
    first, last = mean(task[:WINDOW]), mean(task[-WINDOW:])
    assert not last > first + MARGIN, (first, last, task)
    # it learned what it was paid for: the inverted verdict's mean rose
    assert mean(float(row["reward"]) for row in rollouts[-64 * WINDOW:]) > mean(
        float(row["reward"]) for row in rollouts[:64 * WINDOW])
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["mapping"]["genrm"]["pool"] == "judge" and manifest["mapping"]["genrm"]["devices"] == 1
