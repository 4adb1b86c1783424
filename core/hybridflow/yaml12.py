"""A PyYAML safe loader that reads numbers by YAML 1.2's core schema, so ``1e-6`` is a float, not a string.

PyYAML implements YAML 1.1, whose floats need a dot (``1e-6`` and ``1E5`` stay strings) and whose ints read ``010``
as octal 8. Schema-typed config keys coerce such strings anyway; free-form sections (``model.config``, ``extra``)
pass values through as parsed, so the loader itself must get numbers right. Booleans, nulls and dates are left as
PyYAML reads them. Stability: developer.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["Yaml12Loader", "load_yaml"]

_FLOAT = re.compile(r"""^(?:
    [-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+   # with an exponent: 1e-6, 1E5, -3e-4, +1.0e+3, .5e2
   |[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)                      # with a dot: 1.0, 1., .5, -0.25
   |[-+]?\.(?:inf|Inf|INF)
   |\.(?:nan|NaN|NAN))$""", re.VERBOSE)
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_TAG = "tag:yaml.org,2002:int"


class Yaml12Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 core-schema ints and floats (``1e-6``, ``.5``, ``+1.0e+3``; ``010`` = 10)."""


Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_FLOAT_TAG, _INT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
Yaml12Loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    return int(text, 0) if text.startswith(("0o", "0x")) else int(text)  # decimal "010" is 10, not octal


Yaml12Loader.add_constructor(_INT_TAG, _construct_int)


def load_yaml(text: str) -> Any:
    """Parse ``text`` with :class:`Yaml12Loader` (raises ``yaml.YAMLError`` on bad YAML)."""
    return yaml.load(text, Loader=Yaml12Loader)
