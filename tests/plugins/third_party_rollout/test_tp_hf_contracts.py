"""The third-party rollout engine ``tp_hf`` (tests/fixtures/third_party_rollout, issue #40 item 6) against the public
rollout contract suite, the harness of tests/plugins/fsdp/test_contracts.py; plus what the suite does not check of
the two capabilities it declares: ``bind=True`` takes the tensors without a copy (``binds_generation_weights``),
``weight_tensors()`` lists exactly them and ``sleep()`` drops them (``holds_weights``), and
``verify_declared_capabilities`` accepts the engine against its info record. And ``tp_hf_tg`` (the same engine
declaring ``generates_tensor_parallel``) on 2 gloo ranks at tg = 2, bound to each rank's shards cut as
``GeneratesTensorParallel`` describes them: greedy tokens equal tg = 1's, each rank holding its shards alone.

The distribution is built and installed by pip into a temporary site directory (as tests/core/test_plugins.py does
with the example plugin), which is on ``sys.path`` only while this module runs, so the shared environment and the
other modules' plugin discovery are never changed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams, verify_declared_capabilities
from hybridflow.presets import MODEL_PRESETS
from hybridflow.resharding import count_storage_bytes
from hybridflow.testing.contracts import ROLLOUT_CHECKS
from hybridflow.testing.contracts.rollout import build_prompt_batch, prepare_model, read_weights
from hybridflow.testing.contracts.spawn import run_ranks
from hybridflow.testing.fixtures import EOS_ID, PAD_ID, save_tiny_model

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "third_party_rollout"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The plugin's hook module, imported from a pip-built install of the distribution."""
    site, source = tmp_path_factory.mktemp("tp_hf_site"), tmp_path_factory.mktemp("tp_hf_src") / "src"
    # built from a copy: setuptools writes build/ and egg-info next to the source it builds (tests/e2e's module
    # builds the same fixture, maybe at the same time on the other pytest-xdist worker)
    shutil.copytree(FIXTURE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, timeout=300)
    sys.path.insert(0, str(site))
    try:
        import hybridflow_thirdparty_rollout.plugin as module

        assert Path(module.__file__).is_relative_to(site), module.__file__  # the installed copy, not the source
        yield module
    finally:
        sys.path.remove(str(site))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_hf_contracts")


@pytest.fixture(scope="module")
def make_engine(plugin: Any) -> Callable[[ModelSpec], Any]:
    def make(spec: ModelSpec) -> Any:
        return plugin.build_tp_hf_engine(config=RolloutEngineConfig(model=spec, pad_token_id=PAD_ID,
                                                                    eos_token_id=EOS_ID), device="cpu")
    return make


@pytest.mark.parametrize("check", ROLLOUT_CHECKS, ids=lambda check: check.__name__)
def test_rollout_contract(check, make_engine, workdir: Path) -> None:  # type: ignore[no-untyped-def]
    check(make_engine, workdir)


def test_declared_capabilities_are_implemented(plugin: Any, make_engine, workdir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(ModelSpec(path=str(prepare_model(workdir))))
    assert plugin.INFO.capabilities == {"binds_generation_weights", "holds_weights"}
    verify_declared_capabilities(engine, plugin.INFO, "tp_hf")
    assert plugin.TP_INFO.capabilities == plugin.INFO.capabilities | {"generates_tensor_parallel"}
    config = RolloutEngineConfig(model=ModelSpec(path=str(prepare_model(workdir))), pad_token_id=PAD_ID,
                                 eos_token_id=EOS_ID)
    verify_declared_capabilities(plugin.build_tp_hf_tg_engine(config=config), plugin.TP_INFO, "tp_hf_tg")


def test_bind_takes_the_tensors_without_a_copy_and_sleep_drops_them(make_engine, workdir: Path) -> None:  # type: ignore[no-untyped-def]
    """After ``update_weights(bind=True)`` the engine's weights are the given tensors (same storages: the resident
    bytes of caller + engine are the caller's alone) and its rollout equals a copying update's; ``sleep()`` leaves
    no weight bytes; ``wake()`` + a bound update generates the same again."""
    path = prepare_model(workdir, seed=1)
    weights = {name: tensor.clone() for name, tensor in read_weights(path).items()}
    own = count_storage_bytes(list(weights.values()))
    batch, sampling = build_prompt_batch(), SamplingParams(n=2, max_new_tokens=8, seed=7)

    copied = make_engine(ModelSpec(path=str(prepare_model(workdir, seed=0))))
    copied.update_weights(iter(weights.items()), version=5)
    expected = copied.generate(batch, sampling)
    assert count_storage_bytes([*weights.values(), *copied.weight_tensors()]) == 2 * own  # a copy: twice

    engine = make_engine(ModelSpec(path=str(prepare_model(workdir, seed=0))))
    engine.update_weights(iter(weights.items()), version=5, bind=True)
    held = engine.weight_tensors()
    pointers = {t.untyped_storage().data_ptr() for t in weights.values()}
    assert {t.untyped_storage().data_ptr() for t in held} == pointers  # every weight is a caller's tensor
    assert count_storage_bytes([*weights.values(), *held]) == own  # bound: no second copy
    out = engine.generate(batch, sampling)
    assert out.meta["policy_version"] == 5
    assert torch.equal(out["responses"], expected["responses"])
    assert torch.allclose(out["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-6)

    engine.sleep()
    assert count_storage_bytes(engine.weight_tensors()) == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(batch, sampling)
    engine.wake()
    engine.update_weights(iter(weights.items()), version=6, bind=True)
    again = engine.generate(batch, sampling)
    assert torch.equal(again["responses"], expected["responses"]) and again.meta["policy_version"] == 6


GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)


def tg2_greedy_rank(rank: int, world_size: int, site: str, model_dir: str, out_dir: str) -> None:
    """One rank of ``tp_hf_tg`` at tg = 2 (spawned; the plugin imported from ``site``): bind this rank's shards,
    generate greedily, save the rollout and the bytes held."""
    sys.path.insert(0, site)
    import torch.distributed as dist
    from hybridflow_thirdparty_rollout.engine import tensor_shard
    from hybridflow_thirdparty_rollout.plugin import build_tp_hf_tg_engine

    dist.init_process_group("gloo")
    config = RolloutEngineConfig(model=ModelSpec(path=model_dir), tensor_parallel_size=2, tensor_groups=((0, 1),),
                                 pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    engine = build_tp_hf_tg_engine(config=config, device="cpu")
    assert engine.tensor_rank == rank
    from_path = engine.generate(build_prompt_batch(), GREEDY)  # the path's weights, cut by the engine itself
    full = read_weights(Path(model_dir))
    shards = {name: tensor_shard(name, tensor, rank, 2).clone() for name, tensor in full.items()
              if name != "lm_head.weight"}  # tied: not sent (docs/guide/plugin-authoring.md §5)
    engine.update_weights(iter(shards.items()), version=4, bind=True)
    out = engine.generate(build_prompt_batch(), GREEDY)
    torch.save({"responses": out["responses"], "log_probs": out["rollout_log_probs"],
                "from_path": from_path["responses"], "version": out.meta["policy_version"],
                "held": count_storage_bytes(engine.weight_tensors()),
                "shards": count_storage_bytes(list(shards.values())),
                "together": count_storage_bytes([*shards.values(), *engine.weight_tensors()])},
               Path(out_dir) / f"rank{rank}.pt")


def test_tp_hf_tg_at_tg2_generates_tg1s_greedy_tokens_from_bound_shards(plugin: Any, make_engine,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "model4h", seed=3, **MODEL_PRESETS["tiny-qwen2-4h"])
    reference = make_engine(ModelSpec(path=str(model_dir))).generate(build_prompt_batch(), GREEDY)
    site = str(Path(plugin.__file__).parents[1])
    run_ranks(tg2_greedy_rank, 2, site, str(model_dir), str(tmp_path), workdir=tmp_path, timeout_s=240)
    full = count_storage_bytes(list(read_weights(model_dir).values()))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["responses"], reference["responses"]), (rank, got["responses"], reference["responses"])
        assert torch.equal(got["from_path"], reference["responses"]), rank
        assert (got["log_probs"] - reference["rollout_log_probs"]).abs().max().item() < 1e-4
        assert got["version"] == 4
        # bound: the engine's weights are the shards themselves, about half the model (the norms whole)
        assert got["held"] == got["shards"] == got["together"] < 0.55 * full, (got, full)
