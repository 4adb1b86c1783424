"""``tiny_config`` for module-scoped fixtures (one trainer run read by several tests): conftest's fixture of that
name is function-scoped, so a module-scoped fixture cannot request it; this loads conftest's own builder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hybridflow.config import Config

_spec = importlib.util.spec_from_file_location("_e2e_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
_conftest: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)


def tiny_config(run_dir: Path, *overrides: str) -> Config:
    """GRPO from random init (grpo_arithmetic_scratch.yaml), shortened: conftest's ``tiny_config`` builder."""
    config: Config = _conftest._tiny_config(run_dir, *overrides)
    return config
