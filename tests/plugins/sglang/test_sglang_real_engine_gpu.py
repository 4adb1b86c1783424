"""The real SGLang engine: hybridflow's rollout contract suite plus the colocated release → update → resume cycle.

Marked ``gpu`` (deselected by default) and skipped, with the reason, without sglang or a CUDA GPU. Run on a GPU box:
``pytest -m gpu tests/plugins/sglang`` (see docs/guide/sglang.md). ``HYBRIDFLOW_SGLANG_SERVER_ARGS`` may hold a JSON
object of extra sglang ServerArgs (e.g. ``{"attention_backend": "triton"}``) for GPUs where the defaults do not fit.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from hybridflow.engines import ModelSpec, RolloutEngineConfig, SamplingParams
from hybridflow.testing.contracts.rollout import ROLLOUT_CHECKS, build_prompt_batch, prepare_model, read_weights
from hybridflow.testing.fixtures import EOS_ID, PAD_ID

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason='needs sglang: pip install "hybridflow-sglang[sglang]" (CUDA-only kernels)'),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: sglang has no CPU engine"),
]


@pytest.fixture
def make_engine():
    """Build real sglang engines; each new one shuts the previous down so GPU memory is not held twice."""
    from hybridflow_sglang.engine import SGLangRolloutEngine

    live = []
    server_args = json.loads(os.environ.get("HYBRIDFLOW_SGLANG_SERVER_ARGS", "{}"))

    def build(model: ModelSpec, **extra) -> SGLangRolloutEngine:
        while live:
            live.pop().shutdown()
        options = {"mem_fraction_static": 0.2, "enable_memory_saver": True, "enable_deterministic_inference": True,
                   "server_args": server_args, **extra}
        config = RolloutEngineConfig(model=model, max_prompt_length=16, max_new_tokens=16, pad_token_id=PAD_ID,
                                     eos_token_id=EOS_ID, seed=0, extra=options)
        engine = SGLangRolloutEngine(config, device="cuda:0")
        live.append(engine)
        return engine

    yield build
    while live:
        live.pop().shutdown()


@pytest.mark.parametrize("check", ROLLOUT_CHECKS, ids=lambda check: check.__name__)
def test_rollout_contract_on_the_real_sglang_engine(check, make_engine, tmp_path):
    check(make_engine, tmp_path)


def test_release_update_resume_on_the_real_engine(make_engine, tmp_path):
    path = prepare_model(tmp_path)
    engine = make_engine(ModelSpec(path=str(path)))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(build_prompt_batch(), sampling)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake, "release_memory_occupation freed no GPU memory"
    engine.update_weights(iter(read_weights(path).items()), version=1)
    engine.wake()
    after = engine.generate(build_prompt_batch(), sampling)
    assert torch.equal(before["responses"], after["responses"]) and after.meta["policy_version"] == 1
