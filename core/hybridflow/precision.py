"""``mixed_precision: auto``: bf16 compute (fp32 master weights, optimizer state and gradient reduction) where it pays.

bf16 matmuls run 3.5-4.6x the fp32 ones on a CPU with native bf16 (AVX512-BF16 or AMX) from 64 rows on (one
thread, [rows x hidden] x [hidden x 3*hidden] at hidden 256-512; bench/mixed_precision.py on this project's 2-core
box), and on every GPU since Ampere. On a tiny model a step is dispatch overhead, not arithmetic, and the casts cost
more than the matmuls save (docs/guide/fsdp.md, "Mixed precision": two FSDP ranks at 77K parameters 0.74x, at 600K
1.14-1.16x, 2.4M 1.23-1.24x, 18.9M 1.6-2.0x), so ``auto`` picks bf16 for models of at least
:data:`AUTO_BF16_MIN_PARAMETERS` parameters held in fp32 on an engine whose info record declares
``auto_mixed_precision`` (fsdp), where the device computes bf16
natively, and fp32 otherwise. The choice is made on the driver from the model's config and the driver's own CPU (a
CPU pool's nodes are assumed alike); set ``none`` or ``bf16`` to fix it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.engines import ModelSpec

__all__ = ["AUTO_BF16_MIN_PARAMETERS", "native_bf16", "model_parameters", "resolve_mixed_precision"]

#: ``auto`` picks bf16 from this many parameters on: bench/mixed_precision.py and two-rank bench/e2e_grpo.py runs put
#: the crossover between 77K (bf16 0.5-0.75x fp32) and 600K (two ranks 1.14-1.16x, one process 0.93-1.06x)
AUTO_BF16_MIN_PARAMETERS = 1_000_000


def native_bf16(device: str) -> bool:
    """Whether ``device`` ("cpu" or "cuda") multiplies bf16 natively: CUDA pools are taken to (Ampere or newer, as
    verl assumes); a CPU needs AVX512-BF16 or AMX, read from this process's CPU."""
    if device.startswith("cuda"):
        return True
    import torch

    cpu = getattr(torch, "cpu", None)
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(bool(check()) for check in checks if check is not None)


def model_parameters(model: ModelSpec) -> int | None:
    """The parameter count of ``model`` from its HF config (a dict, or ``config.json`` in its directory); None when
    there is none to read (a hub id)."""
    from hybridflow.placement.models import model_from_hf_config

    config = dict(model.config) if model.config is not None else None
    if config is None and model.path is not None:
        path = Path(model.path).expanduser() / "config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
    if config is None:
        return None
    try:
        return model_from_hf_config(config).parameters
    except (ConfigError, TypeError, ValueError):  # an architecture the shape reader does not know: no basis for bf16
        return None


def resolve_mixed_precision(setting: str, *, engine: str, device: str,
                            model: ModelSpec) -> Literal["none", "bf16"]:
    """``none`` or ``bf16`` for a role's ``mixed_precision`` setting (``auto`` resolved as the module says)."""
    if setting in ("none", "bf16"):
        return "none" if setting == "none" else "bf16"
    from hybridflow import registries
    from hybridflow.engines import training_engine_info
    from hybridflow.plugins import load_plugins

    load_plugins()
    declared = engine in registries.training_engines and training_engine_info(engine).auto_mixed_precision
    if not declared or model.dtype != "float32" or not native_bf16(device):
        return "none"
    parameters = model_parameters(model)
    return "bf16" if parameters is not None and parameters >= AUTO_BF16_MIN_PARAMETERS else "none"
