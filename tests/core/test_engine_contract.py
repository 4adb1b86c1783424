"""The engine contract as the core enforces it: capabilities declared at registration (info records), checked
against the engine when it is built, asked at config time; a worker error that would repeat is not retried."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

from hybridflow import registries
from hybridflow.config import load_config
from hybridflow.engines import (
    ModelSpec,
    RolloutEngineConfig,
    RolloutEngineInfo,
    TrainingEngineInfo,
    rollout_engine_info,
    training_engine_info,
    verify_declared_capabilities,
)
from hybridflow.errors import ConfigError, EngineContractError, WorkerError, is_deterministic
from hybridflow.plugins import load_plugins
from hybridflow.reliability.recovery import RecoveryPolicy, Supervisor


@pytest.fixture(scope="module", autouse=True)
def plugins() -> None:
    load_plugins()


def test_the_first_party_engines_declare_what_the_hybrid_engine_uses() -> None:
    hybrid = {"reshards_generation_weights", "parks_training_weights", "reports_handover", "holds_weights"}
    for name in ("megatron", "deepspeed"):
        assert training_engine_info(name).capabilities == hybrid, name
    # MoE routing replay (R3) and LoRA adapter-only sync
    assert training_engine_info("fsdp").capabilities == {*hybrid, "replays_routing", "hands_over_adapters"}
    # mixed_precision: auto may pick bf16 only where the engine says so (the switch point is the fsdp engine's)
    assert [training_engine_info(n).auto_mixed_precision for n in ("fsdp", "megatron", "deepspeed")] == [
        True, False, False]
    assert rollout_engine_info("hf").capabilities == {"binds_generation_weights", "generates_tensor_parallel",
                                                      "holds_weights", "records_routing", "loads_adapters"}
    vllm = rollout_engine_info("vllm")
    assert vllm.capabilities == {"generates_tensor_parallel", "reports_parameter_shapes"}
    assert (vllm.vocab_multiple, vllm.tensor_parallel_world) == (64, "whole")
    assert rollout_engine_info("sglang").capabilities == frozenset()  # its tensor parallelism is its own workers'


def test_a_built_engine_is_checked_against_its_declaration() -> None:
    """The hf engine implements all it declares; an engine declaring ``binds_generation_weights`` whose
    ``update_weights`` takes no ``bind`` is refused naming the member, and so is one lacking a method."""
    from hybridflow.testing.fixtures import tiny_model_config
    from hybridflow_fsdp.rollout import HFRolloutEngine

    engine = HFRolloutEngine(config=RolloutEngineConfig(model=ModelSpec(config=tiny_model_config())))
    verify_declared_capabilities(engine, rollout_engine_info("hf"), "hf")

    class NoBind:
        capabilities = frozenset({"sleep"})

        def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...

    with pytest.raises(EngineContractError, match=r'"third" .*binds_generation_weights lacks update_weights\(bind'
                                                  r"=\.\.\.\).*generates_tensor_parallel lacks tensor_rank"):
        verify_declared_capabilities(NoBind(), RolloutEngineInfo(capabilities=frozenset(
            {"binds_generation_weights", "generates_tensor_parallel"})), "third")
    with pytest.raises(ConfigError, match=r"unknown capabilities \['bind'\]; known: \['binds_generation_weights'"):
        RolloutEngineInfo(capabilities=frozenset({"bind"}))


@pytest.fixture
def engine_without_tensor_parallel() -> Iterator[str]:
    """A training engine registered with no info record: it declares nothing optional."""
    registries.training_engines.register("plain-test-engine", lambda **_: None, owner="test")
    yield "plain-test-engine"
    registries.training_engines.unregister("plain-test-engine")


def test_what_an_engine_lacks_is_refused_at_config_time(engine_without_tensor_parallel: str) -> None:
    tensor_parallel = ["rollout.tensor_parallel_size=2", "model.preset=tiny-qwen2-4h"]
    with pytest.raises(ConfigError, match=r'capability "generates_tensor_parallel".*rollout.engine = sglang '
                                          r"declares none\. Fix: set rollout.tensor_parallel_size=1"):
        load_config(None, [*tensor_parallel, "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r'capability "reshards_generation_weights".*actor.engine = '
                                          r"plain-test-engine declares none"):
        load_config(None, [*tensor_parallel, f"actor.engine={engine_without_tensor_parallel}"])
    assert training_engine_info(engine_without_tensor_parallel) == TrainingEngineInfo()
    assert load_config(None, tensor_parallel).rollout.tensor_parallel_size == 2  # fsdp + hf declare both


def test_the_first_party_engines_declare_the_config_features_they_implement() -> None:
    assert training_engine_info("fsdp").features == {"lora", "bf16", "gradient_checkpointing",
                                                     "token_budget_micro_batches"}
    assert training_engine_info("megatron").features == {"tensor_parallel", "pipeline_parallel"}
    assert training_engine_info("deepspeed").features == {"bf16", "gradient_checkpointing",
                                                          "token_budget_micro_batches"}
    with pytest.raises(ConfigError, match=r"unknown features \['flash'\]"):
        TrainingEngineInfo(features=frozenset({"flash"}))
    with pytest.raises(ConfigError, match=r'auto_mixed_precision .*without the feature "bf16"'):
        TrainingEngineInfo(auto_mixed_precision=True)


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor.engine=megatron", "actor.lora.rank=4"],
     r'actor\.lora \(LoRA adapters on the actor\) needs a training engine with feature "lora"; training engine '
     r"\"megatron\" declares \['pipeline_parallel', 'tensor_parallel'\]\. Fix: remove the key, or use "
     r"actor\.engine= one of \['fsdp'\]"),
    (["actor.engine=deepspeed", "actor.parallel.tensor_parallel_size=2"],
     r'actor\.parallel\.tensor_parallel_size > 1 needs a training engine with feature "tensor_parallel".*'
     r"one of \['megatron'\]"),
    (["actor.engine=megatron", "actor.gradient_checkpointing=true"],
     r'feature "gradient_checkpointing".*one of \[.*\'deepspeed\', \'fsdp\'\]'),
    (["actor.engine=plain-test-engine", "actor.max_tokens_per_micro_batch=64"],
     r'actor\.max_tokens_per_micro_batch .*training engine "plain-test-engine" declares none'),
])
def test_a_config_feature_the_engine_lacks_is_refused_before_any_worker(
        engine_without_tensor_parallel: str, overrides: list[str], message: str, tmp_path: Any) -> None:
    """A role that turns on a config feature its training engine did not declare is refused while the trainer
    plans its roles (no worker, no Ray), naming the feature and the engines that have it."""
    from hybridflow.trainer import Trainer

    with pytest.raises(ConfigError, match=message):
        Trainer(load_config(None, [f"trainer.run_dir={tmp_path}", *overrides]), progress=False)


class _FailingTrainer:
    """Just enough of :class:`~hybridflow.reliability.supervised.Supervised` for one failing iteration."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.attempts = 0
        self.abandoned = 0

    def current_step(self) -> int:
        return 3

    def trainer_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None: ...

    def train_step(self) -> dict[str, float]:
        self.attempts += 1
        raise self.error

    def abandon_iteration(self) -> None:
        self.abandoned += 1

    def worker_groups(self) -> Any:
        raise AssertionError("recovery restarted worker groups for an error that repeats on every retry")


def test_a_deterministic_worker_error_stops_the_run_without_retries(tmp_path: Any) -> None:
    from hybridflow.reliability.faults import FaultPlan

    assert is_deterministic(EngineContractError("x")) and is_deterministic(ConfigError("x"))
    assert not is_deterministic(RuntimeError("x"))
    error = WorkerError("actor.generate failed on rank 0: EngineContractError: ...", rank=0, deterministic=True)
    trainer = _FailingTrainer(error)
    supervisor = Supervisor(trainer, policy=RecoveryPolicy(max_retries=2),  # type: ignore[arg-type]
                            faults=FaultPlan.from_sources([], tmp_path), run_dir=tmp_path)
    with pytest.raises(WorkerError) as caught:
        supervisor.run_iteration()
    assert caught.value is error and (trainer.attempts, trainer.abandoned) == (1, 1)
    # a transient one (a worker that died or raised something else) goes to recovery, which restarts groups
    transient = _FailingTrainer(WorkerError("rank 0 died", rank=0))
    supervisor = Supervisor(transient, policy=RecoveryPolicy(max_retries=2),  # type: ignore[arg-type]
                            faults=FaultPlan.from_sources([], tmp_path), run_dir=tmp_path)
    with pytest.raises(AssertionError, match="restarted worker groups"):
        supervisor.run_iteration()
