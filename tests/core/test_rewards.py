"""Reward functions: verl's per-sample ``compute_score`` taken as it is, file paths and modules next to the config,
``extra_info`` from the dataset reaching the function, and errors that say what was expected and what was got."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.algorithms.runtime import Runtime
from hybridflow.config import load_config
from hybridflow.data import PromptDataset
from hybridflow.errors import ConfigError, DatasetError, RewardError
from hybridflow.rewards import compute_rule_rewards, resolve_reward_function, score_responses
from hybridflow.testing.fixtures import build_char_tokenizer

#: a reward file as verl users write it (verl/utils/reward_score style): per sample, extra_info optional, a dict
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right answer; extra keys are logged."""
    correct = solution_str.strip() == str(ground_truth)
    bonus = (extra_info or {}).get("weight", 1.0)
    return {"score": float(correct) * bonus, "acc": float(correct), "length": len(solution_str), "note": "text"}


def plain_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5 if data_source == "toy" else 0.0
'''


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_verl_file_named_relative_to_the_config_scores_per_sample(tmp_path: Path) -> None:
    _write(tmp_path / "job" / "rewards", "my_verl_reward.py", VERL_REWARD)
    config_file = _write(tmp_path / "job", "run.yaml", "reward:\n  function: rewards/my_verl_reward.py:compute_score\n")
    config = load_config(config_file)
    assert config.reward.function == f"{(tmp_path / 'job' / 'rewards' / 'my_verl_reward.py').resolve()}:compute_score"
    function = resolve_reward_function(config.reward.function)
    result = score_responses(function, responses=["3", " 9", "x"], ground_truths=["3", "9", "1"],
                             data_sources=["toy"] * 3, extra=[{"weight": 2.0}, None, {}])
    assert result.scores == [2.0, 1.0, 0.0]
    assert result.metrics == {"reward/extra/acc": pytest.approx(2 / 3), "reward/extra/length": pytest.approx(4 / 3)}
    plain = resolve_reward_function(f"{tmp_path / 'job' / 'rewards' / 'my_verl_reward.py'}:plain_score")
    assert compute_rule_rewards(plain, responses=["a", "b"], ground_truths=[1, 1], data_sources=["toy", "x"]) == [
        0.5, 0.0]


def test_a_module_next_to_the_config_imports_without_pythonpath(tmp_path: Path) -> None:
    _write(tmp_path / "job", "verl_next_to_config.py", VERL_REWARD)
    config_file = _write(tmp_path / "job", "run.yaml", "reward:\n  function: verl_next_to_config:compute_score\n")
    with pytest.raises(ModuleNotFoundError):
        __import__("verl_next_to_config")
    function = resolve_reward_function(load_config(config_file).reward.function)
    assert compute_rule_rewards(function, responses=["7"], ground_truths=["7"], data_sources=["d"]) == [1.0]
    # a dotted override of the same key resolves against the config file's folder too
    _write(tmp_path / "job" / "pkg", "__init__.py", "")
    _write(tmp_path / "job" / "pkg", "helpers.py", "def half(x):\n    return x / 2\n")
    _write(tmp_path / "job" / "pkg", "scoring.py", """
        from .helpers import half

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return half(float(solution_str == ground_truth))
        """)
    config = load_config(config_file, ["reward.function=pkg.scoring:compute_score"])
    function = resolve_reward_function(config.reward.function)
    assert compute_rule_rewards(function, responses=["7", "1"], ground_truths=["7", "7"], data_sources=["d"] * 2) == [
        0.5, 0.0]


def test_batched_functions_get_extra_info_too() -> None:
    seen: list[Any] = []

    def batched(*, responses: list[str], ground_truths: list[Any], data_sources: list[str],
                extra: list[dict[str, Any]] | None) -> list[float]:
        seen.append(extra)
        return [float(e["index"]) for e in extra or []]

    assert compute_rule_rewards(batched, responses=["a", "b"], ground_truths=[0, 0], data_sources=["s", "s"],
                                extra=[{"index": 4}, {"index": 7}]) == [4.0, 7.0]
    assert seen == [[{"index": 4}, {"index": 7}]]


def test_extra_info_reaches_the_reward_through_the_runtime(tmp_path: Path) -> None:
    """Dataset rows → PromptDataset batch → (a rollout keeps non-tensor columns) → Runtime.score → function."""
    path = _write(tmp_path, "verl_runtime_reward.py", VERL_REWARD)
    tokenizer = build_char_tokenizer()
    rows = [{"prompt": "1+2=", "data_source": "toy", "reward_model": {"ground_truth": "3"},
             "extra_info": {"weight": 3.0}},
            {"prompt": "2+2=", "data_source": "toy", "reward_model": {"ground_truth": "4"}}]
    prompts = PromptDataset.from_rows(rows, tokenizer, max_prompt_length=6).batch([0, 1], uids=["a", "b"])
    assert list(prompts["extra_info"]) == [{"weight": 3.0}, {}]
    responses = [tokenizer("3", add_special_tokens=False)["input_ids"], tokenizer("4", add_special_tokens=False)[
        "input_ids"]]
    generated = prompts.repeat_interleave(1)
    generated["responses"] = torch.tensor(responses)
    generated["response_mask"] = torch.ones(2, 1)
    generated["attention_mask"] = torch.ones(2, 7, dtype=torch.long)
    config = load_config(None, [f"reward.function={path}:compute_score"])
    runtime = Runtime(config=config, tokenizer=tokenizer,
                      reward_fn=resolve_reward_function(config.reward.function))
    scored = runtime.score(generated)
    assert scored["scores"].tolist() == [3.0, 1.0]  # the weight of row 0 came from its extra_info
    metrics = runtime.summarize(scored)
    assert metrics["reward/extra/acc"] == 1.0 and metrics["reward/extra/length"] == 1.0


def test_dataset_extra_info_must_be_a_mapping() -> None:
    tokenizer = build_char_tokenizer()
    rows = [{"prompt": "1+2=", "extra_info": '{"index": 3}'}]
    assert PromptDataset.from_rows(rows, tokenizer, max_prompt_length=6).extra_infos == [{"index": 3}]
    with pytest.raises(DatasetError, match="`extra_info` must be a mapping"):
        PromptDataset.from_rows([{"prompt": "1+2=", "extra_info": [1, 2]}], tokenizer, max_prompt_length=6)


def test_errors_say_what_was_expected_and_got(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken_rewards.py", """
        def two_args(a, b):
            return 1.0

        def no_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"acc": 1.0}

        def text(data_source, solution_str, ground_truth, extra_info=None):
            return "high"

        def raises(data_source, solution_str, ground_truth, extra_info=None):
            raise KeyError("answer")
        """)
    with pytest.raises(ConfigError, match=r"expected a batched reward .* or verl's per-sample compute_score"):
        resolve_reward_function(f"{path}:two_args")
    with pytest.raises(ConfigError, match=r"no callable \"missing\" \(functions it defines: .*no_score"):
        resolve_reward_function(f"{path}:missing")
    with pytest.raises(ConfigError, match=r"does not exist; expected path/to/file.py:function"):
        resolve_reward_function(f"{tmp_path / 'nope.py'}:f")
    arguments = {"responses": ["a"], "ground_truths": ["a"], "data_sources": ["d"]}
    with pytest.raises(RewardError, match=r"without \"score\" on row 0 \(keys: \['acc'\]\)"):
        score_responses(resolve_reward_function(f"{path}:no_score"), **arguments)
    with pytest.raises(RewardError, match="returned str on row 0; expected a number or a dict"):
        score_responses(resolve_reward_function(f"{path}:text"), **arguments)
    with pytest.raises(RewardError, match="raised KeyError on row 0"):
        score_responses(resolve_reward_function(f"{path}:raises"), **arguments)
    with pytest.raises(ConfigError, match='could not import module "no_module_anywhere_xyz"'):
        resolve_reward_function("no_module_anywhere_xyz:f", base_dir=tmp_path)
