"""Test-session setup shared by every test directory.

``hybridflow.controller`` is imported first, as the CLI and trainer do, so its network defaults (a local Ray bound to
loopback) apply before any test module imports Ray itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hybridflow.controller  # noqa: F401
