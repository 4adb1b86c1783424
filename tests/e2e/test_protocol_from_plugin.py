"""A transfer protocol registered by a third-party plugin (entry point, ``hybridflow_register_transfer_protocols``)
drives a real GRPO run chosen by config (``actor.protocols.generate``), through the CLI as a user runs it.

The plugin is installed as metadata plus one module in a temporary site directory on ``PYTHONPATH`` (what pip leaves
behind), so the shared environment is never changed; the driver and every worker process discover it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arithmetic_scratch.yaml"

PLUGIN_SOURCE = '''
"""Test plugin: protocol "front_loaded" gives rank 0 three quarters of the rows (every rank keeps a share: the hybrid
engine's weight gather is collective) and logs each split to $HF_TEST_PROTOCOL_LOG."""
import json
import os

from hybridflow.transfer import RankInput
from hybridflow.hookspecs import hookimpl


class FrontLoaded:
    concatenates = True

    def distribute(self, args, kwargs, context):
        total = len(args[0])
        rest = max(1, total // (4 * (context.world_size - 1))) if context.world_size > 1 else 0
        sizes = [total - rest * (context.world_size - 1)] + [rest] * (context.world_size - 1)
        parts = args[0].split(sizes)
        with open(os.environ["HF_TEST_PROTOCOL_LOG"], "a") as log:
            log.write(json.dumps({"role": context.role, "method": context.method, "rows_per_rank": sizes}) + "\\n")
        return [RankInput(args=(part, *args[1:]), kwargs=dict(kwargs)) for part in parts]

    def collect_ranks(self, context):
        return list(range(context.world_size))

    def collect(self, outputs, context):
        return type(outputs[0]).concat(outputs)


@hookimpl
def hybridflow_register_transfer_protocols(registry):
    registry.register("front_loaded", FrontLoaded())
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("protocol_site")
    dist_info = site / "hybridflow_frontloaded-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: hybridflow-frontloaded\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[hybridflow]\nfrontloaded = hybridflow_frontloaded_plugin\n")
    (site / "hybridflow_frontloaded_plugin.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    return site


def train(site: Path, *overrides: str, log: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_TEST_PROTOCOL_LOG": str(log)}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "hybridflow.cli", "train", "--no-progress", str(EXAMPLE),
               "trainer.tensorboard=false", "trainer.resume=never", "trainer.checkpoint_every=0",
               "trainer.deadline_s=120", "trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0",
               *overrides]
    return subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.slow  # ~30 s: a fresh Ray and a 2-step run in a subprocess
def test_plugin_protocol_chosen_by_config_drives_generation(tmp_path: Path, plugin_site: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "protocol.jsonl"
    result = train(plugin_site, "trainer.total_steps=2", f"trainer.run_dir={run_dir}",
                   "actor.protocols.generate=front_loaded", log=log)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "done: 2 steps" in result.stdout

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["protocols"]["actor.generate"] == "front_loaded"
    assert manifest["protocols"]["actor.update_policy"] == "mesh_balanced"  # only the overridden method changed
    assert manifest["config"]["actor"]["protocols"] == {"generate": "front_loaded"}
    assert {"name": "frontloaded", "distribution": "hybridflow-frontloaded", "version": "1.0", "disabled": False,
            "error": None} in manifest["plugins"]
    # the protocol's own record: each iteration's 16 prompts were split 12 / 4 over the 2 actor ranks
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(c["role"], c["method"], c["rows_per_rank"]) for c in calls] == [("actor", "generate", [12, 4])] * 2
    # the controller's own call records (the ledger) agree: each iteration's generation ran with it
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 2
    for row in ledger:
        assert [e["protocol"] for e in row["edges"] if e["target"] == "actor.generate"] == ["front_loaded"]

def test_unknown_protocol_name_is_a_config_error_listing_the_known_ones(tmp_path: Path, plugin_site: Path) -> None:
    result = train(plugin_site, f"trainer.run_dir={tmp_path / 'run'}", "actor.protocols.generate=front_loadd",
                   log=tmp_path / "unused.jsonl")
    assert result.returncode == 2, result.stderr[-3000:]
    assert ('ConfigError: actor.protocols.generate: Unknown transfer protocol "front_loadd". Known: '
            in result.stderr), result.stderr[-3000:]
    assert "front_loaded" in result.stderr and "dp_compute" in result.stderr
    assert 'Did you mean "front_loaded"?' in result.stderr
