"""A third-party algorithm, pip-installed and found through its entry point, declares a second reward-model role and
its own state; ``hybridflow train`` builds, trains, checkpoints and resumes it bit-identically with no core change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.trainer.progress import read_metrics
from hybridflow.trainer.timing import is_timing_metric

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "tests" / "fixtures" / "two_reward_plugin"
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("two_reward_site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(PLUGIN)], check=True, timeout=300)
    return target


def train_then_resume(site: Path, straight: Path, resumed: Path) -> subprocess.CompletedProcess[str]:
    """``hybridflow train`` for 2 steps into ``straight``; then ``straight`` less its step-2 checkpoint copied to
    ``resumed`` and trained again from step 1 (``trainer.resume=must``). Both in one fresh interpreter that sees the
    plugin (as after ``pip install``), so they share its Ray."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    common = ["train", "--no-progress", str(EXAMPLE), "trainer.tensorboard=false", "ray.num_cpus=4",
              "algorithm.name=two_reward_grpo", "algorithm.extra.safety_weight=0.5", "reward.model.preset=tiny-qwen2",
              "resource_pools.main.devices_per_node=[1]",  # one worker hosting the three roles: ranks are not tested
              "roles.safety.model.preset=tiny-llama", "data.batch_size=8", "rollout.max_new_tokens=6",
              "trainer.checkpoint_every=1", "trainer.val_every=0", "trainer.val_n=1", "data.task.num_val_prompts=0",
              "trainer.total_steps=2"]
    code = ("import shutil, sys\nfrom hybridflow.cli import main\n"
            f"code = main({[*common, f'trainer.run_dir={straight}']!r})\n"
            "if code:\n    sys.exit(code)\n"
            f"shutil.copytree({str(straight)!r}, {str(resumed)!r}, ignore=shutil.ignore_patterns('step-2'))\n"
            f"sys.exit(main({[*common, f'trainer.run_dir={resumed}', 'trainer.resume=must']!r}))\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def checkpoint(run_dir: Path, step: int) -> tuple[dict[str, str], dict[str, object]]:
    """Checksums of the checkpoint's files (less DCP's ``.metadata``, which holds per-save identifiers) and the
    trainer state."""
    folder = run_dir / "checkpoints" / f"step-{step}"
    checksums = json.loads((folder / "checksums.json").read_text())
    return ({name: digest for name, digest in checksums.items() if not name.endswith(".metadata")},
            json.loads((folder / "trainer_state.json").read_text()))


@pytest.mark.slow
def test_third_party_algorithm_with_two_reward_models_trains_and_resumes(plugin_site: Path, tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_then_resume(plugin_site, straight, resumed)
    manifest = json.loads((straight / "manifest.json").read_text())
    assert manifest["algorithm"] == "two_reward_grpo"
    assert set(manifest["mapping"]) == {"actor", "reward_model", "safety_rm", "rollout"}  # what was built
    assert manifest["protocols"]["safety_rm.compute_scores"] == "mesh"
    assert manifest["mapping"]["safety_rm"]["worker"] == "hybridflow.workers.roles.RewardModelWorker"
    files, state = checkpoint(straight, 2)
    assert {name.split("/")[0] for name in files} >= {"actor", "reward_model", "safety_rm"}
    assert state["algorithm"]["safety_moments"]["count"] == 2 * 8 * 4  # two steps of 8 prompts × 4 samples
    history = read_metrics(straight)
    assert [m["actor/policy_version"] for m in history] == [1.0, 2.0]
    assert all("safety/mean" in m for m in history)

    # resume from step 1 of the same run: the same weights, state and metrics, bit for bit
    resumed_files, resumed_state = checkpoint(resumed, 2)
    assert resumed_state == state
    assert resumed_files == files  # every weight and optimizer shard of every role, bit for bit
    assert ([{k: v for k, v in m.items() if not is_timing_metric(k)} for m in read_metrics(resumed)]
            == [{k: v for k, v in m.items() if not is_timing_metric(k)} for m in history])
