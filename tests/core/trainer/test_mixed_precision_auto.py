"""``mixed_precision: auto`` (the default of every model role) as the trainer plans it (no Ray): bf16 for a model of
at least 1M fp32 parameters on the fsdp engine where the device multiplies bf16 natively, fp32 below, on other
engines and for a model already in bf16; ``rollout.dtype: auto`` generates in the actor's compute dtype. The CPU
probe is replaced (a test double of the hardware) where a test needs the other answer than this machine's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow import precision
from hybridflow.algorithms.grpo import GRPO
from hybridflow.config import Config, load_config
from hybridflow.engines import ModelSpec
from hybridflow.errors import ConfigError
from hybridflow.testing.fixtures import tiny_model_config
from hybridflow.trainer.build import build_tokenizer, plan_roles

#: 18.9M parameters (bench/e2e_grpo.py's "20m"), and the README job's 77K
BIG = {"hidden_size": 512, "intermediate_size": 1024, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}


def _config(*overrides: str, model: dict[str, object] | None = None) -> Config:
    config = load_config(None, list(overrides))
    if model is not None:  # built, not overridden (an override's YAML reads rms_norm_eps "1e-06" as a string)
        config = config.model_copy(update={"model": config.model.model_copy(update={"preset": None,
                                                                                    "config": model})})
    return config


def _actor(config: Config) -> tuple[str, str]:
    plan = next(p for p in plan_roles(config, GRPO().roles(config), tokenizer=build_tokenizer(config.model))
                if p.role == "actor")
    assert plan.spec.rollout_config is not None
    return plan.spec.engine_config.mixed_precision, plan.spec.rollout_config.model.dtype


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test double of a CPU with AVX512-BF16 (this machine's answer is whatever its CPU has)."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)


def test_auto_picks_bf16_for_a_big_model_and_generates_in_bf16(bf16_cpu: None) -> None:
    assert 18_800_000 < (precision.model_parameters(ModelSpec(config=tiny_model_config(**BIG))) or 0) < 19_000_000
    assert _actor(_config(model=tiny_model_config(**BIG))) == ("bf16", "bfloat16")
    # the README job's model stays in fp32: there the casts cost more than the bf16 matmuls save
    assert _actor(_config()) == ("none", "float32")


def test_auto_keeps_fp32_where_bf16_does_not_pay_or_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)  # a CPU without native bf16 (double)
    assert _actor(_config(model=tiny_model_config(**BIG))) == ("none", "float32")
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    big = ModelSpec(config=tiny_model_config(**BIG))
    assert precision.resolve_mixed_precision("auto", engine="megatron", device="cpu", model=big) == "none"
    bf16_weights = ModelSpec(config=tiny_model_config(**BIG), dtype="bfloat16")
    assert precision.resolve_mixed_precision("auto", engine="fsdp", device="cpu", model=bf16_weights) == "none"
    # a hub id has no config to count: no basis for bf16
    assert precision.resolve_mixed_precision("auto", engine="fsdp", device="cpu",
                                             model=ModelSpec(path="org/name")) == "none"


def test_explicit_settings_win_and_rollout_dtype_can_differ(bf16_cpu: None) -> None:
    assert _actor(_config("actor.mixed_precision=none", model=tiny_model_config(**BIG))) == ("none", "float32")
    assert _actor(_config("actor.mixed_precision=bf16")) == ("bf16", "bfloat16")
    assert _actor(_config("actor.mixed_precision=bf16", "rollout.dtype=float32")) == ("bf16", "float32")
    assert _actor(_config("rollout.dtype=bfloat16")) == ("none", "bfloat16")
    with pytest.raises(ConfigError, match="mixed_precision"):
        load_config(None, ["actor.mixed_precision=fp8"])


def test_a_model_directory_is_counted_from_its_config_json(tmp_path: Path, bf16_cpu: None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_model_config(**BIG)))
    assert precision.resolve_mixed_precision("auto", engine="fsdp", device="cpu",
                                             model=ModelSpec(path=str(tmp_path))) == "bf16"
    (tmp_path / "config.json").write_text(json.dumps(tiny_model_config()))
    assert precision.resolve_mixed_precision("auto", engine="fsdp", device="cpu",
                                             model=ModelSpec(path=str(tmp_path))) == "none"


def test_this_machines_probe_reads_the_cpu_flags() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not flags:
        pytest.skip("no /proc/cpuinfo to compare with")
    expected = any(f" {flag}" in flags for flag in ("avx512_bf16", "amx_tile"))
    assert precision.native_bf16("cpu") == expected
    assert precision.native_bf16("cuda")


def test_sft_resolves_auto_as_rl_does(bf16_cpu: None) -> None:
    """``hybridflow sft``'s actor takes the same ``auto``: fp32 for the shipped 77K job, bf16 compute and bf16
    greedy validation for a big model (the spec its worker builds engines from; nothing started)."""
    from hybridflow.trainer.sft import SFTTrainer, load_sft_config

    example = Path(__file__).resolve().parents[3] / "examples" / "sft_arithmetic.yaml"
    config = load_sft_config(example, ["trainer.progress=false"])
    specs = {"shipped": SFTTrainer(config)._spec()}
    big = config.model_copy(update={"model": config.model.model_copy(update={
        "preset": None, "path": None, "config": tiny_model_config(**BIG)})})
    specs["big"] = SFTTrainer(big)._spec()
    chosen = {name: (spec.engine_config.mixed_precision, spec.rollout_config.model.dtype)
              for name, spec in specs.items()}
    assert chosen == {"shipped": ("none", "float32"), "big": ("bf16", "bfloat16")}, chosen
