"""API-drift check: parse (never import) the released sglang wheel and fail if a method, keyword, field, constant
or output key that ``hybridflow_sglang.api.API_USES`` declares is gone; also check that the plugin's code calls
only declared Engine methods/keywords and that the TEST DOUBLE's signatures are a subset of the real ones.

The wheel (~39 MB, ``pip download sglang==<checked version> --no-deps``) is cached under
``$HYBRIDFLOW_TEST_CACHE`` (default ``~/.cache/hybridflow-tests``); without a reachable package index the wheel
tests skip and say so.
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

import hybridflow_sglang
from hybridflow_sglang.api import API_USES, ENGINE_MODULE, SGLANG_CHECKED_VERSION, ApiUse

from sglang_test_double import FakeSGLangEngine

CACHE = Path(os.environ.get("HYBRIDFLOW_TEST_CACHE", Path.home() / ".cache" / "hybridflow-tests"))
WHEEL_DIR = CACHE / f"sglang-{SGLANG_CHECKED_VERSION}"
PLUGIN_DIR = Path(hybridflow_sglang.__file__).parent


class WheelSource:
    """Python sources of a wheel, read from the zip without extracting or importing anything."""

    def __init__(self, wheel: Path) -> None:
        self._zip = zipfile.ZipFile(wheel)
        self._names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = module.replace(".", "/")
            for path in (f"{base}.py", f"{base}/__init__.py"):
                if path in self._names:
                    self._trees[module] = ast.parse(self._zip.read(path).decode("utf-8"), filename=path)
                    break
            else:
                return None
        return self._trees[module]

    def package_modules(self, package: str) -> list[str]:
        prefix = package.replace(".", "/") + "/"
        return sorted(name[:-3].replace("/", ".").removesuffix(".__init__") for name in self._names
                      if name.startswith(prefix) and name.endswith(".py"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)


def _function(body: list[ast.stmt], name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    return next((node for node in body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.name == name), None)


def _keywords(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [arg.arg for arg in function.args.args + function.args.kwonlyargs if arg.arg not in ("self", "cls")]


def _imported_from(tree: ast.Module, name: str) -> tuple[str, str] | None:
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return node.module, alias.name
    return None


def find_method(source: WheelSource, module: str, cls: str, method: str, depth: int = 0):
    """The method's AST, looked up on the class and then on its bases (followed through ``from x import y``)."""
    tree = source.tree(module)
    node = _class(tree, cls) if tree is not None else None
    if node is None or depth > 8:
        return None
    found = _function(node.body, method)
    if found is not None:
        return found
    for base in node.bases:
        if isinstance(base, ast.Name):
            origin = _imported_from(tree, base.id) or (module, base.id)
            found = find_method(source, origin[0], origin[1], method, depth + 1)
            if found is not None:
                return found
    return None


def _class_fields(node: ast.ClassDef) -> set[str]:
    return {stmt.target.id for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}


def find_problems(source: WheelSource, use: ApiUse) -> list[str]:
    """What of ``use`` is missing from the sglang sources (empty when everything is there)."""
    where = f"{use.module}:{use.owner or ''}{'.' if use.owner and use.member else ''}{use.member or ''}"
    if use.owner == "*":
        modules = [use.module] + source.package_modules(use.module)
        fields = {f for m in modules if (t := source.tree(m)) is not None
                  for n in ast.walk(t) if isinstance(n, ast.ClassDef) for f in _class_fields(n)}
        return [f"{where}: no class declares field {k!r}" for k in use.keywords if k not in fields]
    tree = source.tree(use.module)
    if tree is None:
        return [f"module {use.module} not found"]
    if use.owner == "<strings>":
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return [f"{where}: string {k!r} no longer appears" for k in use.keywords if k not in strings]
    if use.owner is None and use.member is None:
        values = {t.id: n.value.value for n in tree.body
                  if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                  for t in n.targets if isinstance(t, ast.Name)}
        problems = []
        for item in use.keywords:
            name, _, value = item.partition("=")
            if values.get(name, object()) != value:
                problems.append(f"{where}: constant {name} is {values.get(name, 'missing')!r}, expected {value!r}")
        return problems
    if use.owner is None:
        function = _function(tree.body, use.member or "")
    elif use.member is None:
        node = _class(tree, use.owner)
        if node is None:
            return [f"{where}: class not found"]
        return [f"{where}: field {k!r} not declared" for k in use.keywords if k not in _class_fields(node)]
    else:
        function = find_method(source, use.module, use.owner, use.member)
    if function is None:
        return [f"{where}: not found"]
    names = _keywords(function)
    return [f"{where}: keyword {k!r} not accepted (accepts {names})" for k in use.keywords if k not in names]


@pytest.fixture(scope="session")
def sglang_source() -> WheelSource:
    wheels = sorted(WHEEL_DIR.glob("sglang-*.whl"))
    if not wheels:
        WHEEL_DIR.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=WHEEL_DIR.parent, prefix="download-"))
        command = [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_CHECKED_VERSION}", "--no-deps",
                   "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                   "--platform", "manylinux_2_34_x86_64", "--disable-pip-version-check", "--quiet", "-d", str(staging)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip(f"pip download sglang=={SGLANG_CHECKED_VERSION} timed out after 600 s (package index slow "
                        "or unreachable); the API-drift check needs the wheel")
        downloaded = sorted(staging.glob("sglang-*.whl"))
        if done.returncode or not downloaded:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip(f"could not download sglang=={SGLANG_CHECKED_VERSION} (package index unreachable?): "
                        f"{(done.stderr or done.stdout).strip()[-400:]}")
        if not WHEEL_DIR.exists():
            staging.rename(WHEEL_DIR)  # atomic: a concurrent session sees all of it or nothing
        wheels = sorted(WHEEL_DIR.glob("sglang-*.whl"))
    return WheelSource(wheels[0])


@pytest.mark.parametrize("use", API_USES, ids=lambda u: f"{u.module.rsplit('.', 1)[-1]}:{u.owner}.{u.member}")
def test_declared_sglang_api_exists_in_the_released_wheel(sglang_source, use):
    assert find_problems(sglang_source, use) == []


def test_the_checker_reports_drift(sglang_source):
    """Negative controls: a renamed keyword, method, field and constant value are each reported."""
    assert find_problems(sglang_source, ApiUse(module=ENGINE_MODULE, owner="Engine", member="generate",
                                               keywords=("input_ids", "input_token_ids")))
    assert find_problems(sglang_source, ApiUse(module=ENGINE_MODULE, owner="Engine", member="update_weights"))
    assert find_problems(sglang_source, ApiUse(module="sglang.srt.arg_groups.fields", owner="*", member=None,
                                               keywords=("tensor_parallel_degree",)))
    assert find_problems(sglang_source, ApiUse(module="sglang.srt.constants", owner=None, member=None,
                                               keywords=("GPU_MEMORY_TYPE_KV_CACHE=kv",)))
    assert find_problems(sglang_source, ApiUse(module="sglang.srt.no_such_module", owner=None, member="f"))


@pytest.mark.parametrize("use", [u for u in API_USES if u.owner == "Engine"], ids=lambda u: str(u.member))
def test_test_double_signatures_are_a_subset_of_the_real_engine(sglang_source, use):
    real = find_method(sglang_source, use.module, "Engine", use.member)
    assert real is not None
    fake = [p for p in inspect.signature(getattr(FakeSGLangEngine, use.member)).parameters if p != "self"]
    real_names = _keywords(real) + ([real.args.kwarg.arg] if real.args.kwarg else [])
    assert set(fake) <= set(real_names), f"FakeSGLangEngine.{use.member} accepts {set(fake) - set(real_names)}"
    assert set(use.keywords) <= set(fake)


def _engine_calls(path: Path) -> list[tuple[str, set[str]]]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "_engine"):
            calls.append((node.func.attr, {kw.arg for kw in node.keywords if kw.arg}))
    return calls


def test_plugin_code_calls_only_declared_engine_methods_and_keywords():
    declared = {u.member: set(u.keywords) for u in API_USES if u.owner == "Engine"}
    calls = [call for path in sorted(PLUGIN_DIR.glob("*.py")) for call in _engine_calls(path)]
    assert len(calls) >= 8, "expected the adapter's self._engine.<method>(...) calls"
    for method, keywords in calls:
        assert method in declared, f"self._engine.{method} is not declared in API_USES"
        assert keywords <= declared[method], f"{method} uses undeclared keywords {keywords - declared[method]}"
