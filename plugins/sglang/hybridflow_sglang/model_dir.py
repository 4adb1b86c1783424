"""Turn a :class:`hybridflow.engines.ModelSpec` into the Hugging Face directory ``sglang.Engine(model_path=...)`` loads.

A ``path`` is used as is. A ``config`` (random init: the trainer's presets) is written to a temporary directory with
the spec's seed and dtype, config.json plus safetensors weights; no tokenizer (the adapter sends token ids,
``skip_tokenizer_init=True``). The engine that asked owns its cleanup. Stability: developer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hybridflow.engines import ModelSpec
from hybridflow.model_dir import write_random_init_model_dir

__all__ = ["prepare_model_dir"]


def prepare_model_dir(spec: ModelSpec) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The model directory for ``spec`` and the temporary directory holding it (None for ``spec.path``)."""
    if spec.path is not None:
        return Path(spec.path), None
    return write_random_init_model_dir(spec, prefix="hybridflow-sglang-model-", engine="sglang")
