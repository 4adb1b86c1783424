"""Hook implementations of hybridflow-sglang: rollout engine ``sglang``, layout ``sglang`` and a capability report.

Hook implementations only; sglang itself is imported inside the engine factory, never at plugin load.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hybridflow.engines import RolloutEngineInfo
from hybridflow.hookspecs import hookimpl
from hybridflow_sglang.api import SGLANG_CHECKED_VERSION


@hookimpl
def hybridflow_register_rollout_engines(registry: Any) -> None:
    from hybridflow_sglang.engine import build_sglang_rollout_engine

    # its tensor parallelism runs in sglang's own workers: no generation layout on the actor's ranks
    registry.register("sglang", build_sglang_rollout_engine, info=RolloutEngineInfo(weights_target="hf"))


@hookimpl
def hybridflow_register_layouts(registry: Any) -> None:
    from hybridflow_sglang.layout import build_sglang_layout

    registry.register("sglang", build_sglang_layout)


@hookimpl
def hybridflow_report_capabilities() -> dict[str, str]:
    installed = importlib.util.find_spec("sglang") is not None
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        has_gpu = False
    if installed and has_gpu:
        engine = "sglang installed and a CUDA GPU is visible"
    elif installed:
        engine = "sglang installed but no CUDA GPU is visible; the engine cannot start here"
    else:
        engine = (f'needs a CUDA GPU and sglang (checked against {SGLANG_CHECKED_VERSION}): '
                  'pip install "hybridflow-sglang[sglang]"; not executable on this machine')
    return {
        "engine": engine,
        "sleep": "release/resume_memory_occupation when extra.enable_memory_saver=True; absent otherwise",
        "seed": "sampling_seed when extra.enable_deterministic_inference=True; absent otherwise",
        "weight_update": "update_weights_from_tensor (same node) or update_weights_from_distributed (other pool)",
    }
