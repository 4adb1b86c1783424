"""The fixture of the end-to-end GRPO benches (``bench/e2e_grpo.py``, ``bench/e2e_sizes.py``,
``bench/hybrid_step.py``, ``bench/mixed_precision.py``): batch shape, model sizes, and the /proc readings of a run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PROMPTS, SAMPLES, NEW_TOKENS, MAX_OPERAND, NUM_ROWS = 16, 4, 16, 99, 1024

#: model sizes (``--size``; ``bench/e2e_sizes.py`` runs them all): name → keyword arguments of
#: ``tiny_model_config`` and the steps (warmup steps) of each of ``bench/e2e_sizes.py``'s runs there
SIZES: dict[str, dict[str, Any]] = {
    "77k": {"model": {"num_heads": 4, "num_kv_heads": 2}, "steps": 20, "warmup": 3},
    # not in e2e_sizes.py's default grid: a point between 77K and 2.4M for mixed_precision: auto's threshold
    "600k": {"model": {"hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "num_heads": 4,
                       "num_kv_heads": 2}, "steps": 12, "warmup": 3},
    "2.4m": {"model": {"hidden_size": 256, "intermediate_size": 512, "num_layers": 4, "num_heads": 8,
                       "num_kv_heads": 4}, "steps": 8, "warmup": 2},
    "20m": {"model": {"hidden_size": 512, "intermediate_size": 1024, "num_layers": 8, "num_heads": 8,
                      "num_kv_heads": 4}, "steps": 5, "warmup": 2},
}


def model_config_of(size: str) -> dict[str, Any]:
    """The HF config dict of model size ``size`` (one of :data:`SIZES`)."""
    from hybridflow.testing.fixtures import tiny_model_config

    values = tiny_model_config(**SIZES[size]["model"])
    values.pop("torch_dtype", None)
    return values


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident bytes of process ``pid`` (VmHWM), or of this process when None."""
    import resource

    if pid is None:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has run (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
