"""Which product modules may import which: read from the source (AST), so a lazy or TYPE_CHECKING import counts."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _product_modules() -> dict[str, Path]:
    """Dotted name → file of every module in the core and plugin packages."""
    packages = [ROOT / "core" / "hybridflow", *sorted((ROOT / "plugins").glob("*/hybridflow_*"))]
    modules = {}
    for package in packages:
        for file in sorted(package.rglob("*.py")):
            parts = file.relative_to(package.parent).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return modules


def imported_modules(file: Path) -> set[str]:
    """Every module ``file`` imports anywhere (top level, in functions, under TYPE_CHECKING): ``from a import b``
    counts as ``a`` and ``a.b`` (``b`` may be a submodule)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), filename=str(file))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_the_packages() -> None:
    modules = _product_modules()
    assert "hybridflow.trainer.build" in modules and "hybridflow.testing.fixtures" in modules
    assert any(name.startswith("hybridflow_fsdp") for name in modules)
    # the walk finds a lazy import inside a function (build_model_spec's)
    assert "hybridflow.presets" in imported_modules(modules["hybridflow.trainer.build"])


def test_product_code_does_not_import_hybridflow_testing() -> None:
    offenders = {name: sorted(m for m in imported_modules(file) if _inside(m, "hybridflow.testing"))
                 for name, file in _product_modules().items() if not _inside(name, "hybridflow.testing")}
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, (f"product modules import hybridflow.testing (test support): {offenders}; import the product "
                           "module it re-exports instead (hybridflow.presets, hybridflow.char_tokenizer)")
