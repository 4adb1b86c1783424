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


def _package_of(module: str) -> str:
    """``hybridflow.reliability.recovery`` → ``hybridflow.reliability``; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def _package_graph() -> dict[str, set[str]]:
    """Subpackage → the other subpackages of hybridflow it imports (anywhere in any of its modules)."""
    modules = _product_modules()
    graph: dict[str, set[str]] = {}
    for name, file in modules.items():
        if not name.startswith("hybridflow."):
            continue
        source = _package_of(name)
        for module in imported_modules(file):
            if module.startswith("hybridflow.") and (module in modules or module.rsplit(".", 1)[0] in modules):
                target = _package_of(module)
                if target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_reliability_does_not_import_the_trainer() -> None:
    graph = _package_graph()
    assert "hybridflow.reliability" in graph["hybridflow.trainer"]  # the one direction: the trainer uses recovery
    assert "hybridflow.trainer" not in graph["hybridflow.reliability"], (
        "hybridflow.reliability imports hybridflow.trainer (even under TYPE_CHECKING counts): the Supervisor sees "
        "the run through hybridflow.reliability.supervised.Supervised")


def test_no_import_cycle_between_core_packages() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check finds one
    assert _cycles(_package_graph()) == []


def test_reliability_touches_no_private_attribute_of_another_object() -> None:
    package = ROOT / "core" / "hybridflow" / "reliability"
    touched = []
    for file in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"))):  # os._exit
                touched.append(f"{file.name}:{node.lineno} .{node.attr}")
    assert not touched, f"reliability reaches into private state of other objects: {touched}"
