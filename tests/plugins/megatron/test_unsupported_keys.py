"""The megatron engine refuses the generic engine keys it does not implement (mixed_precision,
gradient_checkpointing) with the fix, instead of ignoring them."""

from __future__ import annotations

import pytest

from hybridflow.engines import LoraConfig, ModelSpec, TrainingEngineConfig
from hybridflow.errors import ConfigError

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/install_megatron.sh)")
pytestmark = pytest.mark.megatron

from hybridflow_megatron.engine import MegatronTrainingEngine  # noqa: E402


@pytest.mark.parametrize("option, fix", [
    ({"mixed_precision": "bf16"}, "set critic.model.dtype=bfloat16"),
    ({"gradient_checkpointing": True}, "transformer_overrides: {recompute_granularity: full"),
    ({"lora": LoraConfig(rank=4)}, "set critic.engine=fsdp"),
    ({"max_tokens_per_micro_batch": 256}, "set critic.micro_batch_size"),
])
def test_unimplemented_keys_are_refused_before_any_setup(option: dict, fix: str) -> None:
    config = TrainingEngineConfig(model=ModelSpec(config={"model_type": "qwen2"}), **option)
    with pytest.raises(ConfigError) as info:
        MegatronTrainingEngine(role="critic", config=config)
    key = next(iter(option))
    assert f"critic.{key}" in str(info.value) and "Fix: " in str(info.value) and fix in str(info.value)
