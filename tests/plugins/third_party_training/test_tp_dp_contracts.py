"""The third-party training engine ``tp_dp`` (tests/fixtures/third_party_training, issue #40 item 6) against the
public training contract suite (the harness of tests/plugins/fsdp/test_contracts.py): a few steps lower the loss,
every role computes its columns, a checkpoint resumes bit-identically, and 2 gloo ranks end where 1 rank does (the
check a rank that skipped the gradient all-reduce or its optimizer step fails). Plus what the suite does not check:
the capability it declares (``holds_weights``) against its info record, that its generation weights are its
parameters themselves (no copy to hand over), that the checkpoint is written whole or not at all and exports as a
Hugging Face model, and that what it cannot do is refused naming the key.

The distribution is built and installed by pip into a temporary site directory (as the rollout fixture's harness,
tests/plugins/third_party_rollout/test_tp_hf_contracts.py, does), which is on ``sys.path`` only while this module runs;
the spawned ranks inherit it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.engines import (
    LoraConfig,
    ModelSpec,
    ParallelConfig,
    TrainingEngineConfig,
    verify_declared_capabilities,
)
from hybridflow.errors import CheckpointError, ConfigError, EngineContractError
from hybridflow.resharding import count_storage_bytes
from hybridflow.testing.contracts import TRAINING_CHECKS, check_data_parallel_matches_single
from hybridflow.testing.contracts.rollout import prepare_model, read_weights
from hybridflow.testing.contracts.training import build_training_batch, sequence_mean_nll

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "third_party_training"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The plugin's hook module, imported from a pip-built install of the distribution."""
    site, source = tmp_path_factory.mktemp("tp_dp_site"), tmp_path_factory.mktemp("tp_dp_src") / "src"
    # built from a copy: setuptools writes build/ and egg-info next to the source it builds (tests/e2e's module
    # builds the same fixture, maybe at the same time on the other pytest-xdist worker)
    shutil.copytree(FIXTURE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, timeout=300)
    sys.path.insert(0, str(site))
    try:
        import hybridflow_thirdparty_training.plugin as module

        assert Path(module.__file__).is_relative_to(site), module.__file__  # the installed copy, not the source
        yield module
    finally:
        sys.path.remove(str(site))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_dp_contracts")


@pytest.mark.parametrize("check", TRAINING_CHECKS, ids=lambda check: check.__name__)
def test_training_contract(check, plugin: Any, workdir: Path) -> None:  # type: ignore[no-untyped-def]
    check(lambda role, config: plugin.build_tp_dp_engine(role=role, config=config, device="cpu"), workdir)


# spawns a 1-rank and a 2-rank group, each rank importing torch and transformers: 146 s wall at a load of 28 on the
# 2-core box (the whole module: 43 CPU-seconds)
@pytest.mark.slow
def test_two_ranks_match_one_rank(plugin: Any, workdir: Path) -> None:
    """Where a rank that skips the gradient all-reduce is caught (checked by hand: key biases 0.015 apart)."""
    check_data_parallel_matches_single(plugin.build_tp_dp_engine, workdir, world_size=2, steps=3, atol=1e-5)


def _config(workdir: Path, **options: Any) -> TrainingEngineConfig:
    return TrainingEngineConfig(model=ModelSpec(path=str(prepare_model(workdir))), micro_batch_size=2, **options)


def test_declared_capability_is_implemented_and_generation_weights_are_the_parameters(plugin: Any,
                                                                                      workdir: Path) -> None:
    """``holds_weights`` is all it declares and implements; the weights it hands over are its parameters' own
    storage (a binding rollout engine then holds no second copy), under transformers' names, the tied
    ``lm_head.weight`` left out, equal to the model directory's."""
    engine = plugin.build_tp_dp_engine(role="actor", config=_config(workdir), device="cpu")
    assert plugin.INFO.capabilities == {"holds_weights"}
    verify_declared_capabilities(engine, plugin.INFO, "tp_dp")
    handed = dict(engine.generation_weights(target="hf"))
    on_disk = read_weights(prepare_model(workdir))
    assert set(handed) == set(on_disk) - {"lm_head.weight"}
    assert all(torch.equal(handed[name], on_disk[name]) for name in handed)
    held = engine.weight_tensors()
    assert count_storage_bytes([*handed.values(), *held]) == count_storage_bytes(held)
    with pytest.raises(EngineContractError, match='weights_target="hf"'):
        engine.generation_weights(target="vllm")


def test_checkpoint_is_replaced_whole_and_exports_as_a_hugging_face_model(plugin: Any, workdir: Path,
                                                                         tmp_path: Path) -> None:
    """A second save over the first replaces it, leaving no scratch directory; the exporter's output loads in
    transformers with the engine's weights; a directory that is not a checkpoint is refused naming what is missing."""
    from transformers import AutoModelForCausalLM

    engine = plugin.build_tp_dp_engine(role="actor", config=_config(workdir), device="cpu")
    path = tmp_path / "checkpoints" / "step-1"
    engine.save_checkpoint(str(path))
    engine.train_step(build_training_batch(), loss_fn=sequence_mean_nll)
    engine.save_checkpoint(str(path))
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1"]
    assert {"config.json", "engine.json", "model.safetensors", "optimizer.pt"} <= {p.name for p in path.iterdir()}
    plugin.export_tp_dp_checkpoint(checkpoint=path, spec=None, out_dir=tmp_path / "hf")
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    for name, tensor in engine.generation_weights():
        assert torch.equal(exported[name], tensor), name
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        plugin.export_tp_dp_checkpoint(checkpoint=tmp_path, spec=None, out_dir=tmp_path / "none")


def test_reward_model_from_a_sequence_classification_directory_scores_as_transformers_does(plugin: Any,
                                                                                            tmp_path: Path) -> None:
    """A reward model directory as ``hybridflow rm`` writes it (sequence classification, 1 label, ``score`` head)
    loads whole (no fresh head) and each row's score is transformers' own, read at its last attended token."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from hybridflow.presets import tiny_model_config
    from hybridflow.testing.fixtures import PAD_ID

    values = tiny_model_config()
    assert values["pad_token_id"] == PAD_ID  # what sequence classification pools by
    config = AutoConfig.for_model(values.pop("model_type"), **values, num_labels=1)
    torch.manual_seed(5)
    reference = AutoModelForSequenceClassification.from_config(config).eval()
    reference.save_pretrained(tmp_path / "rm")
    batch = build_training_batch()
    engine = plugin.build_tp_dp_engine(role="reward_model", config=TrainingEngineConfig(
        model=ModelSpec(path=str(tmp_path / "rm"), seed=9), micro_batch_size=3), device="cpu")
    scores = engine.compute_scores(batch)["scores"]
    mask = batch["attention_mask"]
    with torch.no_grad():  # transformers pools at the last non-pad id: the last attended token of these rows
        expected = reference(input_ids=batch["input_ids"], attention_mask=mask,
                             position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
    assert torch.allclose(scores, expected, atol=1e-5), (scores, expected)


@pytest.mark.parametrize(("options", "key"), [
    ({"parallel": ParallelConfig(tensor_parallel_size=2)}, "tensor_parallel_size"),
    ({"lora": LoraConfig(rank=4)}, "lora"),
    ({"mixed_precision": "bf16"}, "mixed_precision"),
    ({"generation_tensor_parallel_size": 2}, "rollout.tensor_parallel_size"),
])
def test_what_it_cannot_do_is_refused_naming_the_key(plugin: Any, workdir: Path, options: dict[str, Any],
                                                     key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        plugin.build_tp_dp_engine(role="actor", config=_config(workdir, **options), device="cpu")
