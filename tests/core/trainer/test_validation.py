"""Validation metrics (verl names, unbiased best-of-k / pass@k) and the held-out split of the synthetic task."""

from __future__ import annotations

import itertools
import statistics

import pytest

from hybridflow.config import load_config
from hybridflow.data import make_task_rows
from hybridflow.errors import ConfigError, DatasetError
from hybridflow.trainer.validation import build_validation, expected_best_of, summarize_validation


@pytest.mark.parametrize("values, k", [([0.0, 1.0, 0.0, 0.0], 2), ([0.2, 0.9, 0.5, 0.1, 0.7], 3),
                                       ([1.0, 1.0, 0.0], 1), ([0.0, 0.5, 1.0, 0.25], 4)])
def test_expected_best_of_k_equals_the_mean_over_all_k_subsets(values: list[float], k: int) -> None:
    brute = statistics.mean(max(subset) for subset in itertools.combinations(values, k))
    assert expected_best_of(values, k) == pytest.approx(brute)


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    # n = 4 samples, c = 1 correct: pass@2 = 1 - C(3,2)/C(4,2) = 1/2
    assert expected_best_of([0, 0, 1, 0], 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="1 ≤ k ≤ 4"):
        expected_best_of([0, 0, 1, 0], 5)


def test_greedy_metrics_are_exact_match_accuracy_and_mean_reward_per_data_source() -> None:
    metrics = summarize_validation(["a", "a", "a", "b"], ["0", "1", "2", "3"], [1.0, 0.5, 1.0, 0.0], greedy=True)
    assert metrics == {"val-core/a/acc/mean@1": pytest.approx(2 / 3), "val-aux/a/reward/mean@1": pytest.approx(2.5 / 3),
                       "val-core/b/acc/mean@1": 0.0, "val-aux/b/reward/mean@1": 0.0}


def test_sampled_metrics_mean_best_and_pass_at_k() -> None:
    # two prompts × 4 samples: prompt x solved once, prompt y never (one partial answer)
    uids = ["x"] * 4 + ["y"] * 4
    scores = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    metrics = summarize_validation(["s"] * 8, uids, scores, greedy=False)
    assert metrics["val-core/s/acc/mean@4"] == pytest.approx(1 / 8)
    assert metrics["val-core/s/acc/pass@4"] == pytest.approx(0.5)       # x surely solved in 4, y never
    assert metrics["val-aux/s/acc/pass@2"] == pytest.approx(0.25)       # x: 1 - C(3,2)/C(4,2) = 1/2
    assert metrics["val-core/s/acc/best@4/mean"] == metrics["val-core/s/acc/pass@4"]
    assert metrics["val-aux/s/reward/best@4/mean"] == pytest.approx((1.0 + 0.5) / 2)
    assert metrics["val-aux/s/reward/mean@4"] == pytest.approx(1.5 / 8)


def test_held_out_task_prompts_never_occur_in_training() -> None:
    task = load_config(None, ["data.task.max_operand=9", "data.task.num_prompts=200",
                              "data.task.num_val_prompts=20"]).data.task
    train, held_out = make_task_rows(task)
    assert len(train) == 200 and len({r["prompt"] for r in held_out}) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    plain = load_config(None, ["data.task.max_operand=9", "data.task.num_prompts=200"]).data.task
    from hybridflow.tasks.arithmetic import make_arithmetic_rows

    assert make_task_rows(plain) == (make_arithmetic_rows(num_rows=200, max_operand=9, seed=0), [])
    everything = load_config(None, ["data.task.max_operand=9", "data.task.num_val_prompts=100"]).data.task
    with pytest.raises(DatasetError, match="100 distinct prompts"):
        make_task_rows(everything)


def test_validation_settings_that_cannot_work_are_refused() -> None:
    from hybridflow.testing.fixtures import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    with pytest.raises(ConfigError, match="no validation prompts"):
        build_validation(load_config(None, ["trainer.val_every=5"]), tokenizer, [])
    assert build_validation(load_config(None, ["trainer.val_n=4"]), tokenizer, []) is None  # val_every=0: off
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    with pytest.raises(ConfigError, match=r"multiple of rollout.n=4"):
        build_validation(load_config(None, ["trainer.val_every=5", "trainer.val_n=6", "rollout.n=4"]), tokenizer, rows)
    validation = build_validation(load_config(None, ["trainer.val_every=5", "trainer.val_n=8", "rollout.n=4",
                                                     "trainer.total_steps=12"]), tokenizer, rows)
    assert validation is not None
    assert [step for step in range(13) if validation.due(step, 12)] == [0, 5, 10, 12]
