"""Scripts under ``examples/`` loaded as modules by the tests (they are not packages)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_example_script(relative: str) -> ModuleType:
    """``examples/<relative>`` executed as a fresh module."""
    path = ROOT / "examples" / relative
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
