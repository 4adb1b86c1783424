"""The generative reward model's text side and its judge, in this process: templates are checked at config load,
verdict parsers read numbers and yes/no words at the end, a custom parser loads from a file, and the judge worker
(a real ``hf`` rollout engine over a random tiny judge) turns every verdict it cannot use into a failed sample with
its reason, never an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config import load_config
from hybridflow.errors import ConfigError
from hybridflow.genrm import (
    check_template,
    parse_number,
    parse_verdict,
    parse_yes_no,
    render_judge_prompt,
    resolve_verdict_parser,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"


@pytest.mark.parametrize(("text", "expected"), [
    ("Yes", 1.0), ("the answer is correct.", 1.0), ("no", 0.0), ("  WRONG!", 0.0), ("Score: 7", 7.0),
    ("7.", 7.0), ("0.25", 0.25), ("-3", -3.0), ("2", 2.0), ("", None), ("maybe", None), ("7 apples", None),
    ("yes, 1", 1.0), ("1e400", None),
])
def test_default_parser_reads_a_number_or_a_yes_no_word_at_the_end(text: str, expected: float | None) -> None:
    assert parse_verdict(text) == expected


def test_single_kind_parsers_refuse_the_other_kind() -> None:
    assert parse_yes_no("5") is None and parse_yes_no("Yes.") == 1.0
    assert parse_number("yes") is None and parse_number("grade 3") == 3.0


def test_template_fields_are_checked_and_filled() -> None:
    template = "{prompt}|{response}|{ground_truth}|{data_source}|{extra_info[q]}"
    assert check_template(template) == template
    text = render_judge_prompt(template, prompt="1+2=", response="  3 \n", ground_truth=3, data_source="s",
                               extra_info={"q": "why"})
    assert text == "1+2=|3|3|s|why"
    assert render_judge_prompt("{response}{ground_truth}", prompt="", response="x", ground_truth=None,
                               data_source="", extra_info=None) == "x"
    # format specs work as in str.format: the sum left-aligned in two characters
    assert render_judge_prompt(check_template("{ground_truth:<2}={response}="), prompt="", response="7",
                               ground_truth=7, data_source="", extra_info=None) == "7 =7="
    with pytest.raises(KeyError):
        render_judge_prompt(template, prompt="", response="", ground_truth="", data_source="", extra_info={})
    for bad, message in [("{prompt}", "never shows the judge the response"),
                         ("{response} {answer}", r"unknown field \{answer\}.*expected named fields"),
                         ("{response} {}", "positional field"),
                         ("{response} {", "Single '{'.*literal braces")]:
        with pytest.raises(ConfigError, match=message):
            check_template(bad)


def test_config_checks_template_at_load_and_the_judge_replaces_the_default_reward(tmp_path: Path) -> None:
    judge = ["reward.genrm.model.preset=tiny-qwen2"]
    config = load_config(EXAMPLE, judge)
    assert config.reward.genrm is not None and config.reward.function is None  # the judge replaces "arithmetic"
    assert config.reward.genrm.rollout.name == "hf" and config.reward.genrm.parser == "verdict"
    both = load_config(EXAMPLE, [*judge, "reward.function=arithmetic"])
    assert both.reward.function == "arithmetic"  # set explicitly: the rule score is added to the verdicts'
    with pytest.raises(ConfigError, match=r"reward\.genrm\.template: unknown field \{answer\}"):
        load_config(EXAMPLE, [*judge, 'reward.genrm.template="{answer}"'])
    with pytest.raises(ConfigError, match=r"reward\.genrm\.model"):
        load_config(EXAMPLE, ["reward.genrm.pool=main"])
    with pytest.raises(ConfigError, match=r"reward\.genrm\.rollout\.prompt_length"):
        load_config(EXAMPLE, [*judge, "reward.genrm.rollout.prompt_length=0"])
    with pytest.raises(ConfigError, match=r"cost\.genrm: a generative reward model scores the reward only"):
        load_config(EXAMPLE, ["cost.genrm.model.preset=tiny-qwen2"])
    # a relative parser file is anchored at the config file's folder, as reward.function is
    (tmp_path / "judge.py").write_text("def invert(text):\n    return 1.0 - float(text)\n")
    (tmp_path / "run.yaml").write_text(EXAMPLE.read_text())
    anchored = load_config(tmp_path / "run.yaml", [*judge, "reward.genrm.parser=judge.py:invert"])
    assert anchored.reward.genrm is not None
    assert anchored.reward.genrm.parser == f"{(tmp_path / 'judge.py').resolve()}:invert"
    assert resolve_verdict_parser(anchored.reward.genrm.parser)("0.25") == 0.75


def test_unknown_parsers_are_refused_naming_the_known_ones(tmp_path: Path) -> None:
    assert resolve_verdict_parser("yes_no") is parse_yes_no
    with pytest.raises(ConfigError, match=r'reward\.genrm\.parser: Unknown verdict parser "verdicts".*Did you mean '
                                          r'"verdict"'):
        resolve_verdict_parser("verdicts")
    (tmp_path / "p.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match='has no callable "parse"'):
        resolve_verdict_parser(f"{tmp_path / 'p.py'}:parse")


def test_plan_refuses_a_judge_it_cannot_build_before_any_worker_starts(tmp_path: Path) -> None:
    from hybridflow import registries
    from hybridflow.trainer.build import build_tokenizer, plan_roles

    registry_check = load_config(EXAMPLE, ["reward.genrm.model.preset=tiny-qwen2", "reward.genrm.rollout.name=hff"])
    from hybridflow.config import check_registered_names
    from hybridflow.plugins import load_plugins

    load_plugins()
    with pytest.raises(ConfigError, match=r'reward\.genrm\.rollout\.name: Unknown rollout engine "hff"'):
        check_registered_names(registry_check)
    for overrides, message in [
        (["reward.genrm.parser=nope"], r'reward\.genrm\.parser: Unknown verdict parser "nope"'),
        (["reward.genrm.apply_chat_template=true"], r"reward\.genrm\.apply_chat_template.*no chat template"),
        ([f"reward.genrm.model.path={tmp_path / 'missing'}", "reward.genrm.model.preset=null"],
         r"reward\.genrm\.model\.path .* is not a directory"),
        (["reward.genrm.pool=judge"], r"reward\.genrm\.pool is 'judge', not one of resource_pools"),
    ]:
        config = load_config(EXAMPLE, ["reward.genrm.model.preset=tiny-qwen2", *overrides])
        algorithm = registries.algorithms.get("grpo")
        with pytest.raises(ConfigError, match=message):
            plan_roles(config, algorithm.roles(config), tokenizer=build_tokenizer(config.model), algorithm=algorithm)


def _judge_worker(*overrides: str) -> object:
    """A judge worker in this process, planned from the config as the trainer plans it (random tiny judge)."""
    from hybridflow import registries
    from hybridflow.trainer.build import build_tokenizer, plan_roles
    from hybridflow.workers.judge import JudgeWorker

    config = load_config(EXAMPLE, ["reward.genrm.model.preset=tiny-qwen2", 'reward.genrm.template="{response}="',
                                   "reward.genrm.rollout.prompt_length=6", "reward.genrm.rollout.response_length=3",
                                   *overrides])
    algorithm = registries.algorithms.get("grpo")
    plans = plan_roles(config, algorithm.roles(config), tokenizer=build_tokenizer(config.model), algorithm=algorithm)
    (plan,) = [plan for plan in plans if plan.role == "genrm"]
    assert plan.worker is JudgeWorker and plan.pool == "main"
    return JudgeWorker(plan.spec)  # type: ignore[arg-type]


def _rollout(responses: list[str]) -> Batch:
    from hybridflow.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    width = max(len(row) for row in ids)
    padded = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    prompts = torch.tensor([[tokenizer.convert_tokens_to_ids("1")]] * len(responses))
    return Batch({"responses": padded, "response_mask": mask, "input_ids": torch.cat([prompts, padded], 1),
                  "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1)},
                 {"ground_truth": ["1"] * len(responses), "data_source": ["t"] * len(responses)},
                 meta={"iteration": 0, "policy_version": 0})


def test_judge_worker_turns_unusable_verdicts_into_failed_samples(tmp_path: Path) -> None:
    from hybridflow.algorithms.runtime import summarize_verdicts
    from hybridflow.workers.judge import JUDGED, PARSE_FAILURE, PROMPT_TOO_LONG, STATUS_COLUMN

    # a parser that accepts anything: every verdict of the random judge counts, failed_score never shows
    (tmp_path / "any.py").write_text("def length(text):\n    return float(len(text))\n")
    worker = _judge_worker(f"reward.genrm.parser={tmp_path / 'any.py'}:length",
                           "reward.genrm.failed_score=-1")
    out = worker.judge(_rollout(["12", "3", "123456789"]))  # type: ignore[attr-defined]
    assert out[STATUS_COLUMN].tolist() == [JUDGED, JUDGED, PROMPT_TOO_LONG]  # "123456789=" is 10 > 6 tokens
    assert out["genrm_scores"][2] == -1.0 and all(0 <= s <= 3 for s in out["genrm_scores"][:2].tolist())
    # the default parser on a random judge: its verdicts are mostly no number and no yes/no, each a failed sample
    worker = _judge_worker("reward.genrm.rollout.temperature=1.0")
    out = worker.judge(_rollout(["12"] * 32))  # type: ignore[attr-defined]
    failed = out[STATUS_COLUMN] == PARSE_FAILURE
    assert int(failed.sum()) >= 16 and (out["genrm_scores"][failed] == 0.0).all()
    metrics = summarize_verdicts(out[STATUS_COLUMN])
    assert metrics["reward/genrm_parse_failures"] == float(failed.sum())
    assert metrics["reward/genrm_failed_ratio"] == pytest.approx(float(failed.float().mean()))


def test_judge_worker_stops_at_its_timeout_and_fails_the_rows_left(tmp_path: Path) -> None:
    from hybridflow.workers.judge import STATUS_COLUMN, TEMPLATE_FAILURE, TIMED_OUT

    slow = tmp_path / "slow.py"
    slow.write_text("import time\n\ndef parse(text):\n    time.sleep(0.3)\n    return 1.0\n")
    worker = _judge_worker(f"reward.genrm.parser={slow}:parse", "reward.genrm.micro_batch_size=2",
                           "reward.genrm.timeout_s=0.5")
    out = worker.judge(_rollout(["1"] * 8))  # type: ignore[attr-defined]
    status = out[STATUS_COLUMN].tolist()
    # the first micro-batch is judged (0.6 s of parsing), then the time is up: the 6 rows left fail as timeouts
    assert status[:2] == [0, 0] and status[2:] == [TIMED_OUT] * 6, status
    worker = _judge_worker('reward.genrm.template="{response}{extra_info[question]}"')
    assert worker.judge(_rollout(["1"]))[STATUS_COLUMN].tolist() == [TEMPLATE_FAILURE]  # type: ignore[attr-defined]
