"""Turn a :class:`hybridflow.engines.ModelSpec` into the Hugging Face directory vLLM loads.

A ``path`` is used as is. A ``config`` (random init) is written to a temporary directory by
:func:`hybridflow.model_dir.write_random_init_model_dir`; the caller owns its cleanup.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hybridflow.engines import ModelSpec
from hybridflow.errors import ConfigError
from hybridflow.model_dir import write_random_init_model_dir

__all__ = ["prepare_model_dir", "read_checkpoint_shapes"]


def prepare_model_dir(spec: ModelSpec) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The model directory for ``spec`` and the temporary directory holding it (None for ``spec.path``).

    Raises:
        ConfigError: ``spec.path`` has no ``config.json``.
    """
    if spec.path is not None:
        path = Path(spec.path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"rollout model path must be a Hugging Face model directory with config.json; got {path} "
                f"({'missing' if not path.exists() else 'no config.json'}). Pass model.path=<HF dir> or model.config."
            )
        return path, None
    return write_random_init_model_dir(spec, prefix="hybridflow-vllm-model-", engine="vllm")


def read_checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in the safetensors files of ``path`` (headers only; empty if none)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
