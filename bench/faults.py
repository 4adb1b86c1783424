"""Runs the fault-injection matrix on the tiny GRPO task (and PPO with a critic and a reward model on a second pool
for the critic/reward points): for each point one run with the fault, compared with an uninjected run of the same
seed, printing one ``RESULT {json}`` line per point.

Simplified: 4 iterations, a checkpoint every 2, one fault per run; the driver-kill point (``checkpoint.publish``)
runs the trainer in a child process that dies and is resumed. Run: ``.venv/bin/python bench/faults.py`` (about a
minute per point on an idle 2-core box; ``--points actor.update,actor.generate:hang`` for a subset).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_page

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"

#: point (optionally ":hang") → (workload, iteration it fires at)
MATRIX: dict[str, tuple[str, int]] = {
    "actor.generate": ("grpo", 1),
    "actor.handover": ("grpo", 1),
    "actor.log_probs": ("grpo", 1),
    "actor.update": ("grpo", 1),
    "reference.log_probs": ("grpo", 1),
    "generate.before_consume": ("grpo", 1),
    "controller.between_nodes": ("grpo", 1),
    "checkpoint.worker_write": ("grpo", 2),
    "checkpoint.publish": ("grpo", 4),
    "critic.values": ("ppo", 1),
    "critic.update": ("ppo", 1),
    "reward_model.scores": ("ppo", 1),
    "actor.update:hang": ("grpo", 1),
    # the asynchronous path (rollout.pool, k = 1): a rollout worker killed after generating, its weight load of
    # version 1 failing after bucket 0, a hung generation. Lost generations beyond k are redone under the current
    # weights (docs/guide/async.md), so weights_equal is expected False there; the audit must stay clean
    "rollout.generate": ("async", 2),
    "rollout.load_weights": ("async", 1),
    "rollout.generate:hang": ("async", 2),
}

WORKLOADS: dict[str, list[str]] = {
    # GRPO with a reference (kl loss) and recomputed old log-probs, so every actor/reference node exists
    "grpo": ["actor.kl_loss_coef=0.01", "actor.recompute_log_probs=true"],
    # PPO, critic and reward model on their own pool: a fault there restarts only that pool
    "ppo": ["algorithm.name=ppo", "resource_pools.aux={devices_per_node: [1], cpus_per_worker: 0.5}",
            "critic.pool=aux", "reward.model={preset: tiny-qwen2}", "reward.pool=aux"],
    # GRPO generating on a rollout pool of its own one step ahead, its weights synced in 64 KiB buckets (several)
    "async": ["actor.recompute_log_probs=true", "rollout.pool=gen", "trainer.max_staleness=1",
              "resource_pools.gen={devices_per_node: [1], cpus_per_worker: 0.5}",
              "rollout.weight_sync_bucket_bytes=65536"],
}


def build_overrides(run_dir: Path, workload: str, *, steps: int, every: int, faults: list[str],
                    deadline_s: float, resume: str = "never") -> list[str]:
    return [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.tensorboard=false",
            f"trainer.resume={resume}", f"trainer.total_steps={steps}", f"trainer.checkpoint_every={every}",
            "trainer.val_every=0",
            f"reliability.faults={json.dumps(faults)}", f"reliability.deadlines={json.dumps(_deadlines(deadline_s))}",
            *WORKLOADS[workload]]


def _deadlines(seconds: float) -> dict[str, float]:
    return {node: seconds for node in ("actor.generate", "actor.update_policy", "actor.compute_log_probs",
                                       "reference.compute_ref_log_probs", "critic.compute_values",
                                       "critic.update_critic", "reward_model.compute_scores",
                                       "rollout.generate", "rollout.load_weights")}


def train(overrides: list[str], export: Path) -> dict[str, Any]:
    """One run in this process; exports the actor's weights; returns timings and recovery events."""
    from hybridflow.config import load_config
    from hybridflow.trainer import Trainer

    trainer = Trainer(load_config(EXAMPLE, overrides), progress=False)
    started = time.time()
    try:
        trainer.start()
        start_step = trainer.step
        trainer.fit()
        trainer.groups.role("actor").export_hf(str(export))
    finally:
        trainer.close()
    return {"seconds": time.time() - started, "events": trainer.supervisor.events, "start_step": start_step}


def weights_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def audit(run_dir: Path) -> dict[str, Any]:
    from hybridflow.ledger import read_ledger
    from hybridflow.reliability import audit_ledger

    report = audit_ledger(read_ledger(run_dir), samples_per_prompt=4)
    return {"samples_lost": report.samples_lost, "samples_duplicated": report.samples_duplicated,
            "mixed_versions": len(report.mixed_versions), "iterations": report.iterations}


def run_child(args: argparse.Namespace) -> int:
    """``--child``: a trainer process of its own (it may be killed by the fault); exit code tells."""
    from hybridflow.controller import init_ray

    init_ray(num_cpus=4, object_store_memory=300_000_000)
    result = train(json.loads(args.child), Path(args.export))
    Path(args.export, "child.json").write_text(json.dumps(result))
    return 0


def run_point(label: str, base: Path, clean: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    point, _, action = label.partition(":")
    workload, iteration = MATRIX[label]
    spec = f"{point}@{iteration}" + (f":{action}" if action else "")
    run_dir, export = base / label.replace(":", "-"), base / f"{label.replace(':', '-')}-export"
    hang_deadline = args.hang_deadline_s if action == "hang" else args.deadline_s
    overrides = build_overrides(run_dir, workload, steps=args.steps, every=args.checkpoint_every, faults=[spec],
                                deadline_s=hang_deadline)
    started = time.time()
    events: list[dict[str, Any]] = []
    recovered = True
    if point == "checkpoint.publish":
        command = [sys.executable, __file__, "--child", json.dumps(overrides), "--export", str(export)]
        first = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        resumed_overrides = [o.replace("trainer.resume=never", "trainer.resume=auto") for o in overrides]
        export.mkdir(parents=True, exist_ok=True)
        second = subprocess.run([*command[:3], json.dumps(resumed_overrides), *command[4:]], capture_output=True,
                                text=True, timeout=1800)
        recovered = first.returncode == 17 and second.returncode == 0
        if not recovered:
            print(f"# {label}: child exit codes {first.returncode}, {second.returncode}\n{second.stderr[-2000:]}")
        events = [{"iterations_replayed": 0, "what": "driver restart"}]
    else:
        try:
            events = train(overrides, export)["events"]
        except Exception as exc:  # noqa: BLE001 - an unrecovered point is a result, not a crash of the bench
            print(f"# {label}: not recovered: {type(exc).__name__}: {str(exc)[:500]}")
            recovered = False
    elapsed = time.time() - started
    checks = audit(run_dir) if recovered else {}
    replayed = sum(e.get("iterations_replayed", 0) + (1 if str(e.get("what", "")).startswith("iteration") else 0)
                   for e in events)
    if point == "checkpoint.publish":
        resumed_at = json.loads((export / "child.json").read_text())["start_step"] if recovered else args.steps
        replayed = iteration - resumed_at  # the iterations after the last published checkpoint were redone
    return {
        "point": label, "workload": workload, "fault": spec, "recovered": recovered and bool(events),
        "iterations_replayed": replayed,
        # measured from the failed attempt's start to the end of restore (the driver-kill point: the wall-time
        # difference with the clean run, which a loaded box makes noisy)
        "seconds_lost": round(elapsed - clean[workload]["seconds"] if point == "checkpoint.publish"
                              else sum(e.get("seconds_lost", 0.0) for e in events), 1),
        "seconds_wall_delta": round(elapsed - clean[workload]["seconds"], 1),
        "weights_equal": recovered and weights_equal(clean[workload]["export"], export),
        "samples_lost": checks.get("samples_lost"), "samples_duplicated": checks.get("samples_duplicated"),
        "mixed_versions": checks.get("mixed_versions"),
        "pools_restarted": sorted({p for e in events for p in e.get("pools_restarted", [])}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=",".join(MATRIX), help="comma-separated labels of MATRIX")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=120.0)
    parser.add_argument("--hang-deadline-s", type=float, default=15.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--export", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return run_child(args)
    labels = [label.strip() for label in args.points.split(",") if label.strip()]
    unknown = [label for label in labels if label not in MATRIX]
    if unknown:
        parser.error(f"unknown points {unknown}; known: {', '.join(MATRIX)}")
    from hybridflow.controller import init_ray

    init_ray(num_cpus=4, object_store_memory=300_000_000)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="hybridflow-faults-"))
    clean: dict[str, Any] = {}
    for workload in sorted({MATRIX[label][0] for label in labels}):
        run_dir, export = base / f"clean-{workload}", base / f"clean-{workload}-export"
        shutil.rmtree(run_dir, ignore_errors=True)
        timing = train(build_overrides(run_dir, workload, steps=args.steps, every=args.checkpoint_every, faults=[],
                                       deadline_s=args.deadline_s), export)
        clean[workload] = {"seconds": timing["seconds"], "export": export}
        print(f"# clean {workload}: {timing['seconds']:.1f}s, ledger audit {audit(run_dir)}", flush=True)
    for label in labels:
        results_page.result(run_point(label, base, clean, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Fault-injection matrix: recovery and final weights"))
