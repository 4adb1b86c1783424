"""Plugin discovery through real entry points: a pip-built third-party plugin, a broken one, duplicates, disabling.

Plugins are installed with ``pip install --target`` into a temporary directory and exercised in a fresh
interpreter with that directory on ``PYTHONPATH``, so the shared environment is never changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow import plugins, registries
from hybridflow.errors import DuplicateNameError, PluginLoadError, UnknownNameError
from hybridflow.registries import Registry

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin built and installed by pip into its own site directory."""
    target = tmp_path_factory.mktemp("example_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(FIXTURES / "example_plugin")],
        check=True, timeout=300,
    )
    return target


def make_plugin_dist(site: Path, name: str, source: str, *, version: str = "1.0", extra_metadata: str = "") -> None:
    """A distribution ``hybridflow-<name>`` whose entry point is the module ``hybridflow_<name>_plugin`` = ``source``
    (installed metadata only, as pip leaves it: importlib.metadata finds it on ``sys.path``)."""
    dist_info = site / f"hybridflow_{name}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: hybridflow-{name}\nVersion: {version}\n{extra_metadata}"
    )
    (dist_info / "entry_points.txt").write_text(f"[hybridflow]\n{name} = hybridflow_{name}_plugin\n")
    (site / f"hybridflow_{name}_plugin.py").write_text(source)


def make_broken_plugin(site: Path, *, name: str = "broken", import_error: str = "missing_backend_xyz") -> None:
    """A distribution whose plugin module fails to import (its backend is not installed)."""
    make_plugin_dist(site, name, f"import {import_error}\n", version="0.3.1",
                     extra_metadata="Provides-Extra: backend\n")


LOAD_AND_PRINT_ERROR = """
    from hybridflow import plugins
    try:
        plugins.load_plugins()
    except Exception as exc:
        print(type(exc).__name__, exc)
    """


def run_python(code: str, *site_dirs: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(s) for s in site_dirs] + [full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=120)


def run_cli(*args: str, site_dirs: tuple[Path, ...] = (), env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return run_python(f"import sys; from hybridflow.cli import main; sys.exit(main({list(args)!r}))",
                      *site_dirs, env=env)


def test_importing_hybridflow_loads_no_plugin_and_no_backend() -> None:
    result = run_python(
        """
        import sys, hybridflow, hybridflow.plugins
        print(sorted(m for m in sys.modules if m.startswith("hybridflow_") or m in ("ray", "vllm", "megatron")))
        print(hybridflow.plugins.plugin_infos())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "[]"]


def test_installed_third_party_plugin_is_discovered_and_usable(example_site: Path) -> None:
    result = run_python(
        """
        import json
        from hybridflow import plugins, registries
        infos = {i.name: i for i in plugins.load_plugins()}
        reward = registries.rewards.get("example_length")
        print(json.dumps({
            "dist": infos["example"].distribution, "version": infos["example"].version,
            "registered": infos["example"].registered,
            "owner": registries.rewards.owner("example_length"),
            "reward": reward(responses=["abcd", ""], ground_truths=[None, None], data_sources=["x", "x"]),
        }))
        """,
        example_site,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["dist"] == "hybridflow-example" and data["version"] == "0.2.0"
    assert data["registered"]["reward function"] == ["example_length"]
    assert data["owner"] == "hybridflow-example"
    assert data["reward"] == [0.4, 0.0]


def test_cli_lists_first_party_and_example_plugins(example_site: Path) -> None:
    result = run_cli("plugins", site_dirs=(example_site,))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for name in ("fsdp", "megatron", "vllm", "sglang", "deepspeed", "example"):
        assert name in rows, result.stdout
    assert "hybridflow-example" in rows["example"] and "0.2.0" in rows["example"]
    assert "example_length" in rows["example"]


def test_broken_plugin_raises_plugin_load_error_with_fields(tmp_path: Path) -> None:
    make_broken_plugin(tmp_path)
    result = run_python(
        """
        from hybridflow import plugins
        from hybridflow.errors import PluginLoadError
        try:
            plugins.load_plugins()
        except PluginLoadError as exc:
            print(exc.plugin, exc.distribution, exc.version, type(exc.cause).__name__)
            print(exc)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    first, message = result.stdout.strip().splitlines()[:2]
    assert first == "broken hybridflow-broken 0.3.1 ModuleNotFoundError"
    assert "No module named 'missing_backend_xyz'" in message
    assert 'pip install "hybridflow-broken[backend]"' in message
    assert "HYBRIDFLOW_DISABLE_PLUGINS=broken" in message


def test_cli_shows_load_error_and_strict_fails(tmp_path: Path) -> None:
    make_broken_plugin(tmp_path)
    relaxed = run_cli("plugins", site_dirs=(tmp_path,))
    assert relaxed.returncode == 0
    assert "LOAD ERROR" in relaxed.stdout and "missing_backend_xyz" in relaxed.stdout
    strict = run_cli("plugins", "--strict", site_dirs=(tmp_path,))
    assert strict.returncode == 1
    assert "1 plugin(s) failed to load" in strict.stdout


def test_disable_variable_skips_import(tmp_path: Path) -> None:
    make_broken_plugin(tmp_path)
    result = run_cli("plugins", "--strict", site_dirs=(tmp_path,), env={"HYBRIDFLOW_DISABLE_PLUGINS": "broken, sglang"})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "disabled" in rows["broken"] and "disabled" in rows["sglang"]


def test_duplicate_registration_names_both_owners(tmp_path: Path, example_site: Path) -> None:
    # a second distribution registering the same reward name as the example plugin
    make_plugin_dist(tmp_path, "clash", "from hybridflow.hookspecs import hookimpl\n"
                     "@hookimpl\ndef hybridflow_register_rewards(registry):\n"
                     "    registry.register('example_length', lambda **k: [])\n")
    result = run_python(LOAD_AND_PRINT_ERROR, tmp_path, example_site)
    out = result.stdout
    assert "example_length" in out and "registered twice" in out, out + result.stderr
    assert "hybridflow-example" in out and "hybridflow-clash" in out


def test_misspelled_hook_fails_at_startup(tmp_path: Path) -> None:
    make_plugin_dist(tmp_path, "typo", "from hybridflow.hookspecs import hookimpl\n"
                     "@hookimpl\ndef hybridflow_register_rewardz(registry):\n    pass\n")
    result = run_python(LOAD_AND_PRINT_ERROR, tmp_path)
    assert "hybridflow_register_rewardz" in result.stdout, result.stdout + result.stderr


def test_registry_unknown_name_suggests_nearest() -> None:
    registry: Registry[int] = Registry("rollout engine")
    registry.register("vllm", 1, owner="hybridflow-vllm")
    registry.register("sglang", 2, owner="hybridflow-sglang")
    with pytest.raises(UnknownNameError) as info:
        registry.get("vlm")
    assert str(info.value) == 'Unknown rollout engine "vlm". Known: sglang, vllm. Did you mean "vllm"?'
    with pytest.raises(DuplicateNameError, match="by hybridflow-vllm and user code"):
        registry.register("vllm", 3)


def test_register_plugin_from_code_uses_same_registries() -> None:
    import types

    module = types.ModuleType("in_code_plugin")
    exec(
        "from hybridflow.hookspecs import hookimpl\n"
        "@hookimpl\ndef hybridflow_register_rewards(registry):\n"
        "    registry.register('in_code_reward', lambda **k: [1.0])\n",
        module.__dict__,
    )
    try:
        info = plugins.register_plugin(module, name="in_code")
        assert info.registered == {"reward function": ["in_code_reward"]}
        assert registries.rewards.owner("in_code_reward") == "in_code"
    finally:
        registries.rewards.unregister("in_code_reward")
        plugins.get_plugin_manager().unregister(name="in_code")


def test_plugin_load_error_type_is_public() -> None:
    assert issubclass(PluginLoadError, Exception)


def test_plugin_protocol_drives_a_real_worker_group(example_site: Path) -> None:
    """The example plugin's transfer protocol, discovered by entry point, dispatches calls of a Ray worker group: of
    three ranks, the odd one gets no call and returns nothing (three workers are the fewest that show both)."""
    result = run_python(
        """
        import json
        from hybridflow.plugins import load_plugins
        from hybridflow.controller import init_ray, ResourcePool, WorkerGroup, Worker, register

        class Echo(Worker):
            @register(protocol="example_even_ranks")
            def whoami(self, tag: str) -> str:
                return f"{tag}:{self.rank}"

        load_plugins()
        init_ray(num_cpus=2, object_store_memory=100_000_000)
        pool = ResourcePool("example", devices_per_node=[3], device="cpu", cpus_per_worker=0.25)
        group = WorkerGroup(pool, {"echo": Echo}, name="example", deadline_s=60)
        print(json.dumps(group.echo.whoami("hi")))
        group.shutdown()
        pool.release()
        """,
        example_site,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["hi:0", "hi:2"]
