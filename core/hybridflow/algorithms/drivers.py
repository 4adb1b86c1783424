"""Registers the built-in algorithm drivers in :data:`hybridflow.registries.algorithms`."""

from __future__ import annotations
