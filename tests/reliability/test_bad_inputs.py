"""Bad input, hypothesis-driven (> 200 cases): malformed configs, datasets, reward functions and plugins each raise
a typed error naming the key, file, function or plugin and the fix; `hybridflow train` prints no traceback."""

from __future__ import annotations

import importlib.metadata
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.config import load_config
from hybridflow.data import PromptDataset, load_rows
from hybridflow.errors import ConfigError, DatasetError, HybridflowError, PluginLoadError, RewardError
from hybridflow.rewards import compute_rule_rewards
from hybridflow.testing.fixtures import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def assert_clean(error: BaseException, *names: str) -> None:
    text = str(error)
    assert isinstance(error, HybridflowError)
    assert "Traceback" not in text
    for name in names:
        assert name in text, (name, text)


# --- configs ------------------------------------------------------------------------------------------------
SECTIONS = ["trainer", "actor", "rollout", "data", "algorithm", "reliability", "actor.optim", "ray"]
INT_KEYS = ["trainer.total_steps", "trainer.keep_checkpoints", "rollout.n", "rollout.max_new_tokens",
            "data.batch_size", "data.max_prompt_length", "actor.micro_batch_size", "actor.ppo_epochs"]
POSITIVE_FLOAT_KEYS = ["actor.optim.lr", "trainer.deadline_s", "rollout.top_p"]
identifiers = st.from_regex(r"[a-z][a-z_]{2,12}", fullmatch=True)
junk_text = st.sampled_from(["abc", "[1, 2]", "{a: 1}", "one", "1.5.2", "yes please"])


@st.composite
def bad_config(draw: st.DrawFn) -> tuple[list[str], str]:
    kind = draw(st.sampled_from(["unknown", "type", "range", "parallel", "batch", "fault", "literal"]))
    if kind == "unknown":
        section = draw(st.sampled_from(SECTIONS))
        key = f"{section}.{draw(identifiers)}x"
        return [f"{key}=1"], key
    if kind == "type":
        key = draw(st.sampled_from(INT_KEYS))
        return [f"{key}={draw(junk_text)}"], key
    if kind == "range":
        if draw(st.booleans()):
            key = draw(st.sampled_from(INT_KEYS))
            return [f"{key}={draw(st.integers(-1000, 0))}"], key
        key = draw(st.sampled_from(POSITIVE_FLOAT_KEYS))
        value = draw(st.floats(-1e6, 0.0) | st.floats(1.0001, 1e6)) if key == "rollout.top_p" else \
            draw(st.floats(-1e6, 0.0))
        return [f"{key}={value!r}"], key
    if kind == "parallel":
        devices = draw(st.integers(1, 8))
        tensor = draw(st.integers(2, 16).filter(lambda t: devices % t))
        return [f"resource_pools.main.devices_per_node=[{devices}]", f"actor.parallel.tensor_parallel_size={tensor}"], \
            "actor.parallel"
    if kind == "batch":
        devices = draw(st.integers(2, 8))
        batch = draw(st.integers(1, 200).filter(lambda b: b % devices))
        return [f"resource_pools.main.devices_per_node=[{devices}]", f"data.batch_size={batch}"], "data.batch_size"
    if kind == "fault":
        return [f"reliability.faults=[\"{draw(identifiers)}@1\"]"], "fault point"
    key = draw(st.sampled_from(["rollout.engine", "algorithm.kl_kind", "trainer.resume", "actor.loss_agg"]))
    value = draw(identifiers)
    if key == "rollout.engine":  # a free string checked against the registry later, not here
        return [f"trainer.resume={value}zz"], "trainer.resume"
    return [f"{key}={value}zz"], key


@settings(max_examples=90, **SETTINGS)
@given(bad_config())
def test_malformed_config_names_the_key(case: tuple[list[str], str]) -> None:
    overrides, key = case
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, overrides)
    assert_clean(info.value, key)
    if key != "actor.parallel":  # see test_parallel_size_error_says_how_to_fix
        assert any(word in str(info.value) for word in ("Fix", "must", "expected", "Did you mean"))


def test_parallel_size_error_says_how_to_fix() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["resource_pools.main.devices_per_node=[1]", "actor.parallel.tensor_parallel_size=2"])
    assert any(word in str(info.value) for word in ("Fix", "set ", "lower", "raise"))


@settings(max_examples=15, **SETTINGS)
@given(st.sampled_from([b"{a: [1, 2", b"- just\n- a list\n", b"\xff\xfe\x00bad", b"key: [unclosed"]))
def test_unreadable_config_file_names_the_file(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "broken.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path, [])
    assert_clean(info.value, str(path))


# --- datasets -----------------------------------------------------------------------------------------------
TOKENIZER = build_char_tokenizer()


@st.composite
def bad_dataset(draw: st.DrawFn) -> tuple[str, bytes, str]:
    kind = draw(st.sampled_from(["empty", "blank", "missing_column", "bad_json", "not_object", "encoding", "too_long",
                                 "suffix", "empty_prompt", "prompt_type"]))
    good = b'{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}}\n'
    if kind == "empty":
        return ".jsonl", b"", "empty"
    if kind == "blank":
        return ".jsonl", b"\n" * draw(st.integers(1, 5)), "empty"
    if kind == "missing_column":
        column = draw(identifiers.filter(lambda c: c != "prompt"))
        return ".jsonl", f'{{"{column}": "1+2="}}\n'.encode(), "prompt"
    if kind == "bad_json":
        line = draw(st.integers(1, 4))
        return ".jsonl", good * (line - 1) + b'{"prompt": "1+\n', f":{line}:"
    if kind == "not_object":
        return ".jsonl", draw(st.sampled_from([b"[1, 2]\n", b'"text"\n', b"3\n"])), "JSON object"
    if kind == "encoding":
        return ".jsonl", good + draw(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\x80abc"])) + b"\n", "UTF-8"
    if kind == "too_long":
        length = draw(st.integers(9, 40))
        return ".jsonl", f'{{"prompt": "{"1" * length}"}}\n'.encode(), "max_prompt_length"
    if kind == "suffix":
        return draw(st.sampled_from([".csv", ".txt", ""])), good, "expected .parquet or .jsonl"
    if kind == "empty_prompt":
        return ".jsonl", b'{"prompt": ""}\n', "empty"
    return ".jsonl", draw(st.sampled_from([b'{"prompt": 5}\n', b'{"prompt": [1, 2]}\n', b'{"prompt": null}\n'])), \
        "prompt"


@settings(max_examples=70, **SETTINGS)
@given(bad_dataset())
def test_malformed_dataset_names_the_file(tmp_path_factory: pytest.TempPathFactory,
                                          case: tuple[str, bytes, str]) -> None:
    suffix, content, expected = case
    path = tmp_path_factory.mktemp("data") / f"train{suffix}"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as info:
        rows = load_rows(path)
        PromptDataset.from_rows(rows, TOKENIZER, max_prompt_length=8, source=str(path))
    assert_clean(info.value, str(path), expected)


# --- reward functions ---------------------------------------------------------------------------------------
@st.composite
def bad_reward(draw: st.DrawFn) -> tuple[object, int, str]:
    rows = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["raise", "nan", "shape", "type"]))
    if kind == "raise":
        error = draw(st.sampled_from([ValueError, KeyError, ZeroDivisionError, RuntimeError, IndexError]))

        def raising(**_: object) -> list[float]:
            raise error("user bug")

        return raising, rows, error.__name__
    if kind == "nan":
        bad_at = draw(st.integers(0, rows - 1))
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))

        def non_finite(*, responses: list[str], **_: object) -> list[float]:
            return [bad if i == bad_at else 0.5 for i in range(len(responses))]

        return non_finite, rows, f"rows [{bad_at}]"
    if kind == "shape":
        delta = draw(st.integers(-rows, 5).filter(lambda d: d != 0))

        def wrong_shape(*, responses: list[str], **_: object) -> list[float]:
            return [1.0] * (len(responses) + delta)

        return wrong_shape, rows, "expected exactly one float per response"
    value = draw(st.sampled_from([None, 3.0, "high", object()]))

    def wrong_type(**_: object) -> object:
        return value

    return wrong_type, rows, "one number per response"


@settings(max_examples=60, **SETTINGS)
@given(bad_reward())
def test_bad_reward_function_is_a_reward_error_naming_it(case: tuple[object, int, str]) -> None:
    function, rows, expected = case
    with pytest.raises(RewardError) as info:
        compute_rule_rewards(function, responses=["7"] * rows, ground_truths=["7"] * rows,  # type: ignore[arg-type]
                             data_sources=["t"] * rows)
    assert_clean(info.value, function.__qualname__, expected)


@settings(max_examples=10, **SETTINGS)
@given(st.sampled_from(["no_such_module_xyz:score", "json:no_such_function", "os.path:sep", "hybridflow:nope"]))
def test_unresolvable_reward_spec_names_the_key(spec: str) -> None:
    from hybridflow.rewards import resolve_reward_function

    with pytest.raises(ConfigError) as info:
        resolve_reward_function(spec)
    assert_clean(info.value, "reward.function")


# --- plugins ------------------------------------------------------------------------------------------------
@settings(max_examples=20, **SETTINGS)
@given(identifiers, st.sampled_from(["ImportError", "ModuleNotFoundError", "RuntimeError", "SyntaxError",
                                     "AttributeError"]))
def test_plugin_failing_to_import_names_plugin_and_fix(tmp_path_factory: pytest.TempPathFactory, name: str,
                                                       error: str) -> None:
    from hybridflow import plugins

    folder = tmp_path_factory.mktemp("plug")
    module = f"hf_broken_{name}"
    (folder / f"{module}.py").write_text(f"raise {error}('backend missing')\n")
    sys.path.insert(0, str(folder))
    try:
        entry_point = importlib.metadata.EntryPoint(name=name, value=f"{module}", group="hybridflow")
        plugins._load_entry_point(plugins.get_plugin_manager(), entry_point, set())
        info = plugins._infos.pop(name)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(module, None)
    assert isinstance(info.error, PluginLoadError)
    assert_clean(info.error, f'Plugin "{name}"', error, f"HYBRIDFLOW_DISABLE_PLUGINS={name}")


# --- the command line ---------------------------------------------------------------------------------------
def test_cli_reports_bad_inputs_without_traceback(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {
        "unknown key": ([str(EXAMPLE), "trainer.totl_steps=3"], "trainer.totl_steps"),
        "empty dataset": ([str(EXAMPLE), f"data.train_files=[{empty}]", f"trainer.run_dir={tmp_path / 'r1'}"],
                          str(empty)),
        "bad reward": ([str(EXAMPLE), "reward.function=no_such_module_q:score", f"trainer.run_dir={tmp_path / 'r2'}"],
                       "reward.function"),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {label: subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "train", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for label, (argv, _) in cases.items()}
    for label, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (label, stderr)
        assert "Traceback" not in stderr, (label, stderr)
        assert cases[label][1] in stderr, (label, stderr)
