"""Hook implementations of the core itself: what hybridflow registers without any plugin installed.

Registered first by :func:`hybridflow.plugins.get_plugin_manager`; plugins add to the same registries.
"""

from __future__ import annotations
