"""``from hybridflow.algorithms import ...`` is the documented import path of what a driver writes against."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hybridflow.algorithms as algorithms
from hybridflow.algorithms.coefficients import build_kl_state
from hybridflow.algorithms.interface import Algorithm
from hybridflow.algorithms.runtime import Runtime


def test_every_exported_name_resolves_to_its_defining_module() -> None:
    for name in algorithms.__all__:
        value = getattr(algorithms, name)
        assert value.__name__ == name and value.__module__ == algorithms._EXPORTS[name], name
        assert value.__module__.startswith(("hybridflow.algorithms.", "hybridflow.detokenize")), name
    from hybridflow.algorithms import Algorithm as A
    from hybridflow.algorithms import Runtime as R
    from hybridflow.algorithms import build_kl_state as b

    assert (A, R, b) == (Algorithm, Runtime, build_kl_state)
    with pytest.raises(AttributeError, match="no attribute 'Runtimee'"):
        algorithms.Runtimee  # noqa: B018


def test_importing_the_package_stays_cheap() -> None:
    """Plugin discovery imports hybridflow.algorithms.drivers; that must not pull in torch."""
    code = "import sys, hybridflow.algorithms.drivers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
