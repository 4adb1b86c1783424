"""Config: YAML + dotted overrides, errors that name the key path, and `hybridflow train` without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridflow.config import apply_overrides, config_hash, load_config
from hybridflow.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arithmetic_scratch.yaml"


def test_example_loads_and_overrides_apply() -> None:
    config = load_config(EXAMPLE, ["actor.optim.lr=1e-4", "rollout.engine=vllm",
                                   "resource_pools.main.devices_per_node=[4]"])
    assert config.actor.optim.lr == 1e-4
    assert config.rollout.engine == "vllm"
    assert config.resource_pools["main"].world_size == 4
    assert config_hash(config) != config_hash(load_config(EXAMPLE))


@pytest.mark.parametrize("override, key, expected", [
    ("actor.optim.lr=abc", "actor.optim.lr", "valid number"),
    ("actor.optim.lr=-1", "actor.optim.lr", "greater than 0"),
    ("rollout.top_p=2", "rollout.top_p", "less than or equal to 1"),
    ("actr.lr=1", '"actr"', 'Did you mean "actor"?'),
    ("rollout.temprature=0.5", '"rollout.temprature"', 'Did you mean "rollout.temperature"?'),
    ("actor.pool=gpu", "actor.pool", "not one of resource_pools"),
    ("actor.parallel.tensor_parallel_size=3", "actor.parallel", "does not divide"),
    ("data.batch_size=3", "data.batch_size", "multiple of the actor's data-parallel size"),
    ("resource_pools.main.ready_timeout_s=0", "resource_pools.main.ready_timeout_s", "greater than 0"),
])
def test_errors_name_the_key_and_the_problem(override: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [override])
    assert key in str(info.value) and expected in str(info.value)


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match=r"dotted\.key=value"):
        apply_overrides({}, ["actor.optim.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)


def test_cli_reports_bad_config_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(EXAMPLE), "rollout.n=0",
         f"trainer.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "rollout.n" in result.stderr and "greater than 0" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_unknown_engine_suggests_nearest(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(EXAMPLE), "rollout.engine=vlm",
         f"trainer.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert 'rollout.engine: Unknown rollout engine "vlm"' in result.stderr and 'Did you mean "vllm"?' in result.stderr
    assert "Traceback" not in result.stderr


# --- what verl users type (issue 40, item 5) -----------------------------------------------------------------------
def _prompts_file(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "data_source": "probe", "reward_model": {
        "ground_truth": str(i + 1)}}) + "\n" for i in range(n)))
    return path


def test_a_single_data_file_is_a_one_element_list_with_home_expanded(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``data.train_files=~/data/gsm8k/train.parquet`` as verl's examples write it: from the overrides `hybridflow
    train` passes to load_config, and from a YAML file; the expanded paths are the ones the trainer reads."""
    from hybridflow.char_tokenizer import build_char_tokenizer
    from hybridflow.trainer.datasets import load_datasets

    monkeypatch.setenv("HOME", str(tmp_path))
    train = _prompts_file(tmp_path / "data" / "gsm8k" / "train.jsonl", 8)
    val = _prompts_file(tmp_path / "data" / "gsm8k" / "test.jsonl", 3)
    config = load_config(EXAMPLE, ["data.train_files=~/data/gsm8k/train.jsonl",
                                   "data.val_files=~/data/gsm8k/test.jsonl"])
    assert config.data.train_files == [str(train)] and config.data.val_files == [str(val)]
    dataset, validation = load_datasets(config, build_char_tokenizer())
    assert len(dataset) == 8 and validation is not None and len(validation.dataset) == 3

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("data:\n  train_files: ~/data/gsm8k/train.jsonl\n  val_files: [~/data/gsm8k/test.jsonl]\n"
                         "trainer:\n  loggers: jsonl\n")
    from_yaml = load_config(yaml_file)
    assert from_yaml.data.train_files == [str(train)] and from_yaml.data.val_files == [str(val)]
    assert from_yaml.trainer.loggers == ["jsonl"]  # verl's trainer.logger takes one name too
    # a list stays a list, and what is neither a path nor a list says what it expects
    assert load_config(EXAMPLE, [f"data.train_files=[{train}, {train}]"]).data.train_files == [str(train)] * 2
    with pytest.raises(ConfigError, match=r"data\.train_files: expected a file path or a list of file paths"):
        load_config(EXAMPLE, ["data.train_files=3"])


def test_unknown_keys_suggest_the_nearest_known_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The `hybridflow train` command (in process: it stops at the config, before any worker) and a YAML file."""
    from hybridflow.trainer.cli import main as train_main

    assert train_main([str(EXAMPLE), "trainer.total_stepz=3", f"trainer.run_dir={tmp_path}"]) == 2
    stderr = capsys.readouterr().err
    assert 'Unknown config key "trainer.total_stepz" (given 3). Did you mean "trainer.total_steps"?' in stderr
    assert "Traceback" not in stderr

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("trainer:\n  total_steps: 3\nresource_pools:\n  main:\n    devices_per_node: [2]\n"
                         "    cpus_per_workr: 1\nactor:\n  optim:\n    warmup_step: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file)
    message = str(info.value)
    # nested sections, through a dict of pools too; one line per key
    assert 'Unknown config key "resource_pools.main.cpus_per_workr" (given 1). Did you mean ' \
           '"resource_pools.main.cpus_per_worker"?' in message
    assert 'Unknown config key "actor.optim.warmup_step" (given 2). Did you mean "actor.optim.warmup_steps"?' in message
    # nothing close: the section's keys are listed instead
    with pytest.raises(ConfigError, match=r'Unknown config key "trainer\.zzzz" \(given 1\); trainer takes: '
                                          r"total_steps, run_dir, .*Fix: remove it"):
        load_config(EXAMPLE, ["trainer.zzzz=1"])


# --- keys that did nothing are refused with the reason and the fix (issue 15, item 7) ---------------------------------
@pytest.mark.parametrize("override, reason, fix", [
    ("critic.enabled=true", "follows from algorithm.name", "remove critic.enabled"),
    ("critic.clip_ratio_low=0.1", "critic trains on a value loss", "set actor.clip_ratio_low"),
    ("critic.clip_ratio_high=0.3", "critic trains on a value loss", "critic.value_clip"),
    ("critic.entropy_coef=0.01", "actor (policy-loss) key", "set actor.entropy_coef"),
    ("critic.entropy_target=0.1", "actor (policy-loss) key", "set actor.entropy_target"),
    ("reference.entropy_coef_delta=0.01", "reference is frozen", "remove reference.entropy_coef_delta"),
    ("critic.kl_loss_coef=0.1", "actor (policy-loss) key", "set actor.kl_loss_coef"),
    ("critic.kl_loss_kind=k1", "actor (policy-loss) key", "set actor.kl_loss_kind"),
    ("critic.recompute_log_probs=false", "actor (policy-loss) key", "set actor.recompute_log_probs"),
    ("reference.enabled=true", "uses a KL term", "remove reference.enabled"),
    ("reference.optim.lr=0.1", "reference is frozen", "remove reference.optim"),
    ("reference.gradient_checkpointing=true", "reference is frozen", "remove reference.gradient_checkpointing"),
    ("reference.ppo_epochs=2", "reference is frozen", "remove reference.ppo_epochs"),
    ("rollout.pipeline_parallel_size=2", "no rollout engine here generates pipeline-parallel",
     "rollout.pipeline_parallel_size=1"),
])
def test_keys_that_did_nothing_are_refused_with_the_reason(override: str, reason: str, fix: str) -> None:
    key = override.partition("=")[0].split(".")
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [override])
    message = str(info.value)
    assert f"{key[0]}.{key[1]}:" in message and reason in message and "Fix: " in message and fix in message


def test_adaptive_entropy_keys_need_a_target() -> None:
    for override in ("actor.entropy_coef_delta=0.01", "actor.entropy_coef_min=0.01", "actor.entropy_coef_max=0.05"):
        with pytest.raises(ConfigError, match=r"which is not set .*Fix: set actor.entropy_target"):
            load_config(EXAMPLE, [override])
    with pytest.raises(ConfigError, match=r"must be ≥ actor\.entropy_coef_min"):
        load_config(EXAMPLE, ["actor.entropy_target=0.1", "actor.entropy_coef=-0.01"])
    with pytest.raises(ConfigError, match=r"must be ≥ actor.entropy_coef_min \(0.02\)"):
        load_config(EXAMPLE, ["actor.entropy_target=0.1", "actor.entropy_coef=0.01", "actor.entropy_coef_min=0.02"])
    config = load_config(EXAMPLE, ["actor.entropy_target=0.1", "actor.entropy_coef_max=0.05"])
    actor = config.actor
    assert (actor.entropy_target, actor.entropy_coef_delta, actor.entropy_coef_max) == (0.1, 0.001, 0.05)
    # a dumped config (the run's manifest.json) spells every default out and loads again, with and without a target
    for loaded in (config, load_config(EXAMPLE, [])):
        assert type(loaded).model_validate(loaded.model_dump(mode="json")) == loaded


def test_trained_roles_take_gradient_checkpointing_and_mixed_precision() -> None:
    config = load_config(EXAMPLE, ["actor.gradient_checkpointing=true", "critic.gradient_checkpointing=true",
                                   "critic.mixed_precision=bf16", "reference.mixed_precision=bf16"])
    assert config.actor.gradient_checkpointing and config.critic.gradient_checkpointing
    assert (config.critic.mixed_precision, config.reference.mixed_precision) == ("bf16", "bf16")
    assert load_config(EXAMPLE, ["rollout.pipeline_parallel_size=1"]).rollout.pipeline_parallel_size == 1


def test_the_plan_reaches_engine_configs_for_every_role() -> None:
    """gradient_checkpointing and mixed_precision reach the engine configs the trainer plans for each role."""
    from hybridflow import registries
    from hybridflow.plugins import load_plugins
    from hybridflow.testing.fixtures import build_char_tokenizer
    from hybridflow.trainer.build import plan_roles

    config = load_config(EXAMPLE, ["algorithm.name=ppo", "actor.kl_loss_coef=0.1",
                                   "actor.gradient_checkpointing=true", "critic.gradient_checkpointing=true",
                                   "critic.mixed_precision=bf16", "reference.mixed_precision=bf16"])
    load_plugins()
    algorithm = registries.algorithms.get("ppo")
    plans = {plan.role: plan.spec.engine_config for plan in plan_roles(
        config, algorithm.roles(config), tokenizer=build_char_tokenizer(), algorithm=algorithm)}
    assert plans["actor"].gradient_checkpointing and plans["critic"].gradient_checkpointing
    assert not plans["reference"].gradient_checkpointing
    assert (plans["actor"].mixed_precision, plans["critic"].mixed_precision,
            plans["reference"].mixed_precision) == ("none", "bf16", "bf16")


# --- numbers in free-form sections read by YAML 1.2 rules (issue 15, item 9) ---------------------------------------
NUMBERS = {"eps": ("1e-6", 1e-6), "big": ("1E5", 1e5), "half": (".5", 0.5), "neg": ("-3e-4", -3e-4),
           "signed": ("+1.0e+3", 1e3), "count": ("010", 10), "word": ("1e", "1e")}


def free_form_keys() -> list[str]:
    """Every section of the schema that passes values through unchanged (a ``dict[str, Any]``)."""
    import types
    import typing

    from pydantic import BaseModel

    from hybridflow.config import Config

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        found = []
        for name, info in model.model_fields.items():
            union = isinstance(info.annotation, types.UnionType) or typing.get_origin(info.annotation) is typing.Union
            args = typing.get_args(info.annotation) if union else (info.annotation,)
            sections = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if sections:
                found += walk(sections[0], f"{prefix}{name}.")
            elif any(typing.get_origin(a) is dict and typing.get_args(a)[1] is Any for a in args):
                found.append(f"{prefix}{name}")
        return found

    return walk(Config, "")


def _with_model_source(key: str) -> list[str]:
    """Overrides that make the model section around ``key`` valid (model.config replaces the preset)."""
    if key.endswith("model.config"):
        return [f"{key.removesuffix('.config')}.preset=null"]
    if key.startswith("reward.genrm."):  # the judge section needs its model
        return ["reward.genrm.model.preset=tiny-qwen2"]
    if key.startswith("rollout.env."):  # options go to an environment class the section serves
        return ["rollout.env.entry=hybridflow.tasks.tool_calc_env:ToolCalcEnv"]
    return []


def test_free_form_sections_are_all_walked() -> None:
    keys = free_form_keys()
    assert {"model.config", "actor.extra", "critic.extra", "reference.extra", "rollout.extra",
            "actor.model.config", "reward.model.config"} <= set(keys)


@pytest.mark.parametrize("key", free_form_keys())
def test_numbers_in_free_form_sections_from_files(tmp_path: Path, key: str) -> None:
    *parents, leaf = key.split(".")
    text = "".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(parents))
    text += f"{'  ' * len(parents)}{leaf}:\n"
    text += "".join(f"{'  ' * (len(parents) + 1)}{name}: {raw}\n" for name, (raw, _) in NUMBERS.items())
    path = tmp_path / "numbers.yaml"
    path.write_text(text)
    config = load_config(path, _with_model_source(key))
    section = _lookup(config, key)
    assert section == {name: value for name, (_, value) in NUMBERS.items()}
    assert all(type(section[name]) is type(value) for name, (_, value) in NUMBERS.items())


@pytest.mark.parametrize("key", free_form_keys())
def test_numbers_in_free_form_sections_from_overrides(key: str) -> None:
    overrides = _with_model_source(key) + [f"{key}.{name}={raw}" for name, (raw, _) in NUMBERS.items()]
    section = _lookup(load_config(None, overrides), key)
    assert section == {name: value for name, (_, value) in NUMBERS.items()}
    assert all(type(section[name]) is type(value) for name, (_, value) in NUMBERS.items())


def _lookup(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def test_scalar_overrides_follow_yaml_1_2_too() -> None:
    config = load_config(None, ["actor.optim.lr=1E-4", "trainer.deadline_s=.5e3", "actor.optim.warmup_steps=010"])
    assert (config.actor.optim.lr, config.trainer.deadline_s, config.actor.optim.warmup_steps) == (1e-4, 500.0, 10)
