"""reward.num_workers: the rule reward in a pool of spawned processes — faster for slow functions, same results,
dict metrics kept; a call that raises, hangs past the timeout or kills its worker is a failed sample (scored 0,
counted in reward/num_failed), a step whose every call fails raises."""

from __future__ import annotations

import logging
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.algorithms.runtime import combine_chunk_reward_metrics
from hybridflow.errors import RewardError
from hybridflow.rewards import score_responses
from hybridflow.rewards_remote import FAILED_SCORE, RewardPool, build_reward_function

REWARDS = '''
import os
import time


def slow_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)
    return {"score": float(solution_str == ground_truth) + len(solution_str) / 100, "length": len(solution_str)}


def hang(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(600)
    return 1.0


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ValueError(f"cannot score {solution_str!r}")
    if solution_str == "die":
        os._exit(3)
    return 1.0 + len(solution_str) / 100


def batched(*, responses, ground_truths, data_sources, extra=None):
    return [len(r) * 2.0 + (extra[i]["k"] if extra else 0) for i, r in enumerate(responses)]
'''


@pytest.fixture()
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "slow_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def _rows(n: int) -> tuple[list[str], list[str], list[str]]:
    responses = [str(i * 7 % 13) for i in range(n)]
    return responses, [str(i % 13) for i in range(n)], ["probe"] * n


def test_pool_is_faster_and_equal_to_serial(reward_file: Path) -> None:
    responses, truths, sources = _rows(32)
    spec = f"{reward_file}:slow_score"
    serial_fn = build_reward_function(spec)
    assert not isinstance(serial_fn, RewardPool)
    started = time.perf_counter()
    serial = score_responses(serial_fn, responses=responses, ground_truths=truths, data_sources=sources)
    serial_s = time.perf_counter() - started
    pool = build_reward_function(spec, num_workers=4, timeout_s=30)
    assert isinstance(pool, RewardPool)
    try:
        pool.start()  # spawning the workers is paid once per run, not per step
        started = time.perf_counter()
        pooled = score_responses(pool, responses=responses, ground_truths=truths, data_sources=sources)
        pooled_s = time.perf_counter() - started
    finally:
        pool.close()
    assert serial_s >= 32 * 0.05
    assert pooled_s < 0.6 * serial_s, (pooled_s, serial_s)
    assert pooled.scores == serial.scores
    # the dict's extra keys are still averaged into metrics; the pool counts its failed samples (none here)
    assert pooled.metrics == {**serial.metrics, "reward/num_failed": 0.0, "reward/failed_ratio": 0.0}
    assert pooled.metrics["reward/extra/length"] == pytest.approx(sum(len(r) for r in responses) / 32)


def test_batched_function_split_into_chunks(reward_file: Path) -> None:
    responses, truths, sources = _rows(10)
    extra = [{"k": i} for i in range(10)]
    spec = f"{reward_file}:batched"
    serial = score_responses(build_reward_function(spec), responses=responses, ground_truths=truths,
                             data_sources=sources, extra=extra)
    pool = RewardPool(spec, num_workers=3, timeout_s=30)
    try:
        pooled = score_responses(pool, responses=responses, ground_truths=truths, data_sources=sources, extra=extra)
    finally:
        pool.close()
    assert pooled.scores == serial.scores == [len(r) * 2.0 + i for i, r in enumerate(responses)]


def test_hanging_sample_is_a_failed_sample_and_leaves_no_process(reward_file: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    responses = ["a", "b", "hang", "c", "d"]
    pool = RewardPool(f"{reward_file}:hang", num_workers=2, timeout_s=1.0)
    before = {child.pid for child in psutil.Process().children(recursive=True)}  # other tests' processes may live on

    def workers() -> list[psutil.Process]:
        # the pool's (multiprocessing's resource tracker, one per driver process, outlives pools by design)
        return [child for child in psutil.Process().children(recursive=True)
                if child.pid not in before and "resource_tracker" not in " ".join(child.cmdline())]

    pool.start()
    first = workers()
    assert len(first) == 2, [child.cmdline() for child in first]
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards_remote"):
        scored = score_responses(pool, responses=responses, ground_truths=["x"] * 5, data_sources=["s"] * 5)
    assert time.perf_counter() - started < 30
    assert scored.scores == [1.0, 1.0, FAILED_SCORE, 1.0, 1.0]
    assert scored.metrics == {"reward/num_failed": 1.0, "reward/failed_ratio": 0.2}
    assert "hang timed out: no result after 1 s (reward.timeout_s) on sample 2" in caplog.text
    assert "1 of 5 samples failed and were scored 0 (reward/num_failed): sample 2 timed out" in caplog.text
    # the hung worker (and its sibling) were killed; the calls after it ran on a fresh pool, closed here
    _gone, alive = psutil.wait_procs(first, timeout=10)
    assert alive == [], alive
    second = workers()
    assert len(second) == 2 and not {p.pid for p in second} & {p.pid for p in first}
    pool.close()
    _gone, alive = psutil.wait_procs(second, timeout=10)
    assert alive == [], alive
    assert pool._executor is None


def test_raising_and_dying_samples_are_failed_samples(reward_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    # one worker: the call in flight when its process dies is the one that killed it
    pool = RewardPool(f"{reward_file}:flaky", num_workers=1, timeout_s=60)
    responses = ["a", "boom", "bb", "die", "ccc"]
    try:
        with caplog.at_level(logging.WARNING, logger="hybridflow.rewards_remote"):
            scored = score_responses(pool, responses=responses, ground_truths=["x"] * 5, data_sources=["s"] * 5)
    finally:
        pool.close()
    assert scored.scores == [1.01, FAILED_SCORE, 1.02, FAILED_SCORE, 1.03]
    assert scored.metrics == {"reward/num_failed": 2.0, "reward/failed_ratio": 0.4}
    assert "sample 1 raised ValueError: cannot score 'boom'" in caplog.text
    assert "sample 3 failed: a reward worker process died while it ran (BrokenProcessPool" in caplog.text


def test_a_step_whose_every_call_fails_raises(reward_file: Path) -> None:
    pool = RewardPool(f"{reward_file}:batched", num_workers=2, timeout_s=30)
    try:
        # both chunks raise (no "k" in extra): nothing of the step was scored; the first rows' error is named
        with pytest.raises(RewardError, match=r"batched failed on all 3 samples of the step, first on samples 0\.\.1 "
                                              r"raised KeyError: 'k'; .*reward.num_workers=0 to see its traceback"):
            score_responses(pool, responses=["a", "b", "c"], ground_truths=["x"] * 3, data_sources=["s"] * 3,
                            extra=[{}, {}, {}])
        # a batched chunk that raises fails its rows only
        scored = score_responses(pool, responses=["a", "b", "c"], ground_truths=["x"] * 3, data_sources=["s"] * 3,
                                 extra=[{"k": 1}, {"k": 2}, {}])
    finally:
        pool.close()
    assert scored.scores == [3.0, 4.0, FAILED_SCORE]
    assert scored.metrics == {"reward/num_failed": 1.0, "reward/failed_ratio": pytest.approx(1 / 3)}


def test_a_streamed_step_sums_the_failed_count_and_averages_the_rest() -> None:
    chunks = [{"reward/num_failed": 1.0, "reward/failed_ratio": 0.25, "reward/extra/acc": 0.5},
              {"reward/num_failed": 3.0, "reward/failed_ratio": 0.75, "reward/extra/acc": 0.0}]
    assert combine_chunk_reward_metrics(chunks) == {"reward/num_failed": 4.0, "reward/failed_ratio": 0.5,
                                                   "reward/extra/acc": 0.25}


def test_config_pool_through_runtime_score(reward_file: Path) -> None:
    """reward.num_workers from the config → build_reward_function (what the Trainer calls) → Runtime.score."""
    import torch

    from hybridflow.algorithms.runtime import Runtime
    from hybridflow.config import load_config
    from hybridflow.data import PromptDataset
    from hybridflow.testing.fixtures import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rows = [{"prompt": f"{i}+0=", "data_source": "toy", "reward_model": {"ground_truth": str(i)}} for i in range(4)]
    generated = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=6).batch([0, 1, 2, 3],
                                                                                   uids=list("abcd"))
    answers = ["0", "5", "2", "9"]
    generated["responses"] = torch.tensor([tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers])
    generated["response_mask"] = torch.ones(4, 1)
    generated["attention_mask"] = torch.ones(4, 7, dtype=torch.long)
    config = load_config(None, [f"reward.function={reward_file}:slow_score", "reward.num_workers=2",
                                "reward.timeout_s=30"])
    reward = config.reward
    assert reward.function is not None
    pool = build_reward_function(reward.function, num_workers=reward.num_workers, timeout_s=reward.timeout_s)
    assert isinstance(pool, RewardPool) and pool.num_workers == 2 and pool.timeout_s == 30
    try:
        scored = Runtime(config=config, tokenizer=tokenizer, reward_fn=pool).score(generated)
    finally:
        pool.close()
    assert scored["scores"].tolist() == pytest.approx([1.01, 0.01, 1.01, 0.01])
    assert scored.meta["reward_metrics"] == {"reward/extra/length": 1.0, "reward/num_failed": 0.0,
                                             "reward/failed_ratio": 0.0}
