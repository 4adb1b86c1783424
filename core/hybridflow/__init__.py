"""hybridflow: one single controller over an RL dataflow, SPMD worker groups inside each model, engines as plugins.

Importing this package loads no plugin, starts no Ray and imports no engine backend. Call
:func:`hybridflow.plugins.load_plugins` (the CLI and trainer do) to discover installed plugins.
"""

from __future__ import annotations

from hybridflow.errors import HybridflowError
from hybridflow.registries import Registry

__version__ = "0.1.0"

__all__ = ["HybridflowError", "Registry", "__version__"]
