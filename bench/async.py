"""Asynchronous RL on a split rollout pool against the synchronous loops: prompt+response tokens/s and reward per
wall-second of GRPO (examples/grpo_arithmetic_scratch.yaml, shortened) for

- ``colocated``: the synchronous hybrid engine, actor training and generating on one pool of ``--colocated-workers``;
- ``split-k0/k1/k2``: the actor on one pool of 1 worker, generation on a rollout pool of 1 worker
  (``rollout.pool``), ``trainer.max_staleness`` = 0, 1, 2;
- ``split-k0/k1-after-update``: the same with the weight sync and the next generation dispatched once the step's
  update has returned to the driver (``AsyncRollout.sync_behind_update = False``, the schedule before they were
  dispatched right behind the update): the ablation of that change;
- ``split-k0/k1-stream``: ``trainer.stream_mini_batches`` with ``--stream-chunks`` chunks a step (each chunk trained
  the moment it is generated), and ``split-k0/k1-barrier`` the same chunks consumed at once (one update of the
  chunks concatenated, ``AsyncRollout.stream = False``): the ablation of streaming;
- ``split-k0/k1/k2-partial``: ``rollout.partial_rollout`` in segments of ``--partial-tokens`` (an update that ends
  while a generation is in flight is loaded before its next segment): ``partial_mixed_frac`` the mean fraction of
  the rows trained on that were sampled under two or more versions, ``token_staleness_mean`` per token.

Timing covers the training steps after the first (warm-up: it also pays the first weight sync), wall clock from the
end of step 0 to the end of the last step; worker start-up is not counted. ``reward_per_wall_s`` = Σ over the timed
steps of ``reward/mean`` / their seconds; ``reward_last`` the mean reward of the last quarter of the steps.

Where the time goes (the profile of each run, over the timed window): ``actor_busy_frac`` / ``rollout_busy_frac``
the fraction of the wall time the actor's pool / the rollout pool spent inside a call (the colocated pool does both:
its generation counts as rollout), ``overlap_frac`` the fraction both were busy at once, ``trainer_wait_s`` the time
a step waited for its rollout (``async/wait_s``), ``sync_wait_s`` the rollout worker's wait for the actor's weight
export, ``cpu_cores_used`` the CPU seconds of the driver and the workers per wall second (how many cores the run
actually got: on a box with no free core, running the pools side by side cannot shorten a step).

Settings run interleaved, ``--rounds`` times each (seeds × rounds × settings, the order rotated each round), so the
box's load drifts over all of them alike; ``RESULT`` per run, then per setting the median over its runs and the
ratio to ``split-k0`` and to ``colocated``, with the load average. Simplified: one tiny random-init model, CPU
workers, a few steps; compare settings of one invocation only.

``--weight-sync object_store collective`` runs every split setting with each ``rollout.weight_sync`` (labelled
``split-k1/collective`` etc.): ``sync_load_s_per_sync`` is the rollout worker's time from the first byte of a sync
to the weights loaded (the object store: fetch + load; collective: the broadcast of every bucket + load), and
``sync_wait_s`` its wait for the actor's weights before that.

Run: ``OMP_NUM_THREADS=1 python bench/async.py [--steps 8] [--rounds 2] [--seeds 0] [--settings colocated ...]
[--weight-sync object_store collective]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import yaml

import results_page
from hybridflow.config import load_config
from hybridflow.controller import CallRecord, init_ray
from hybridflow.trainer import Trainer
from hybridflow.trainer.async_loop import AsyncRollout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"
SETTINGS = ("colocated", "split-k0", "split-k1", "split-k2", "split-k0-after-update", "split-k1-after-update",
            "split-k0-stream", "split-k0-barrier", "split-k1-stream", "split-k1-barrier", "split-k0-partial",
            "split-k1-partial", "split-k2-partial")
DEFAULT_SETTINGS = ("colocated", "split-k0", "split-k1", "split-k2", "split-k1-after-update")
#: the calls that are generation (on the rollout pool, or the colocated actor's own); a rollout worker's
#: load_weights / receive_weights is neither (most of its time is waiting for the actor's weights: ``sync_wait_s``)
GENERATION = ("generate",)
SYNC_LOADS = ("load_weights", "receive_weights")


def setting_overrides(setting: str, *, colocated_workers: int, cpus_per_worker: float, rows: int = 128,
                      chunks: int = 4, partial_tokens: int = 4) -> list[str]:
    """The config of ``setting``; ``rows`` a step's (prompts × n), cut into ``chunks`` for the streamed ones;
    segments of ``partial_tokens`` for the partial ones."""
    if setting == "colocated":
        pools = {"main": {"devices_per_node": [colocated_workers], "device": "cpu",
                          "cpus_per_worker": cpus_per_worker}}
        return [f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}"]
    staleness = int(setting.removeprefix("split-k").split("-")[0])
    streamed = ["trainer.stream_mini_batches=true", f"actor.mini_batch_size={rows // chunks}"]
    pools = {name: {"devices_per_node": [1], "device": "cpu", "cpus_per_worker": cpus_per_worker}
             for name in ("main", "gen")}
    return [f"resource_pools={yaml.safe_dump(pools, default_flow_style=True).strip()}", "rollout.pool=gen",
            f"trainer.max_staleness={staleness}",
            *(streamed if setting.endswith(("-stream", "-barrier")) else []),
            *(["rollout.partial_rollout=true", f"rollout.partial_rollout_tokens={partial_tokens}"]
              if setting.endswith("-partial") else [])]


def _busy_intervals(records: list[CallRecord], *, generation: bool) -> list[tuple[float, float]]:
    """Per call: (end − the slowest rank's time inside the method, end), for generation calls or the others."""
    return [(record.finished_at - max(record.compute_seconds_per_rank), record.finished_at) for record in records
            if record.compute_seconds_per_rank and record.method not in SYNC_LOADS
            and (record.method in GENERATION) == generation]


def _clip_union(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, stop in sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in first for c, d in second)


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def run_setting(setting: str, seed: int, args: argparse.Namespace, root: Path,
                weight_sync: str = "object_store") -> dict[str, Any]:
    overrides = [
        f"trainer.run_dir={root / f'{setting}-{seed}-{time.time_ns()}'}", f"trainer.seed={seed}",
        f"trainer.total_steps={args.steps}", "trainer.checkpoint_every=0", "trainer.val_every=0", "trainer.val_n=1",
        "data.task.num_val_prompts=0", "trainer.progress=false", "trainer.tensorboard=false", "trainer.resume=never",
        "trainer.log_rollouts=0", f"data.batch_size={args.batch_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
        *setting_overrides(setting, colocated_workers=args.colocated_workers, cpus_per_worker=args.cpus_per_worker,
                           rows=args.batch_size * 4, chunks=args.stream_chunks,  # rows: the example's n = 4
                           partial_tokens=args.partial_tokens),
    ]
    label = setting
    if setting.startswith("split"):
        overrides.append(f"rollout.weight_sync={weight_sync}")
        if len(args.weight_sync) > 1:
            label = f"{setting}/{weight_sync}"
    if args.model_path:
        overrides += [f"model.path={args.model_path}", "reward.function=arithmetic_exact"]
    overrides += args.set
    trainer = Trainer(load_config(args.example, overrides), progress=False)
    records: list[CallRecord] = []
    trainer.call_observers.append(records.append)
    history: list[dict[str, float]] = []
    try:
        trainer.start()  # what fit() does first; its loop below, timed (no validation or checkpoint is due)
        groups = [*trainer.worker_groups().by_pool.values()]
        source = trainer.rollout_source
        if isinstance(source, AsyncRollout):
            source.sync_behind_update = not setting.endswith("-after-update")
            source.stream = source.stream and not setting.endswith("-barrier")
            source.group.observers.append(records.append)
            groups.append(source.group)
        pids = [os.getpid(), *(pid for group in groups for pid in (group.local_process_ids() or {}).values())]
        marks = [time.time()]
        cpu = [_cpu_seconds(pids)]
        while trainer.step < args.steps:
            history.append(trainer.supervisor.run_iteration())
            marks.append(time.time())
            cpu.append(_cpu_seconds(pids))
    finally:
        trainer.close()
    timed = history[1:] or history
    lo, hi = (marks[1], marks[-1]) if len(history) > 1 else (marks[0], marks[-1])
    wall = hi - lo
    tokens = sum(row["tokens/prompt_and_response"] for row in timed)
    last = history[-max(1, len(history) // 4):]
    train = _clip_union(_busy_intervals(records, generation=False), lo, hi)
    generate = _clip_union(_busy_intervals(records, generation=True), lo, hi)
    result: dict[str, Any] = {
        "setting": label, "weight_sync": weight_sync, "seed": seed, "steps": len(history), "timed_steps": len(timed),
        "step_s": wall / len(timed), "tokens_per_s": tokens / wall,
        "reward_per_wall_s": sum(row["reward/mean"] for row in timed) / wall,
        "reward_mean": sum(row["reward/mean"] for row in history) / len(history),
        "reward_last": sum(row["reward/mean"] for row in last) / len(last),
        "reward_per_step": [round(row["reward/mean"], 4) for row in history],
        "actor_busy_frac": sum(b - a for a, b in train) / wall,
        "rollout_busy_frac": sum(b - a for a, b in generate) / wall,
        "overlap_frac": _overlap(train, generate) / wall,
        "cpu_cores_used": (cpu[-1] - cpu[1 if len(history) > 1 else 0]) / wall,
        "load_avg_1m": os.getloadavg()[0],
    }
    if setting.startswith("split"):
        syncs = sum(1 for row in history if row["async/weight_sync_bytes"] > 0)  # steps that checked one sync each
        result.update({
            "trainer_wait_s": sum(row["async/wait_s"] for row in timed) / len(timed),
            "sync_wait_s": sum(row["async/weight_sync_wait_s"] for row in timed) / len(timed),
            "sync_load_s": sum(row["async/weight_sync_load_s"] for row in timed) / len(timed),
            "sync_load_s_per_sync": sum(row["async/weight_sync_load_s"] for row in history) / max(1, syncs),
            "sync_bytes_per_sync": sum(row["async/weight_sync_bytes"] for row in history) / max(1, syncs),
            "staleness_mean": sum(row["async/staleness_mean"] for row in history) / len(history),
            "staleness_max": max(row["async/staleness_max"] for row in history),
            "dropped_stale_samples": history[-1]["async/dropped_stale_samples_total"],
        })
        if setting.endswith("-partial"):
            result.update({
                "partial_mixed_frac": sum(row["async/partial_mixed_version_frac"] for row in history) / len(history),
                "token_staleness_mean": sum(row["async/token_staleness_mean"] for row in history) / len(history),
                "syncs_loaded_in_flight": sum(row["async/weight_sync_in_flight"] for row in history),
            })
    return result


def reward_gap(runs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, float]:
    """How far a setting's reward per step is from split k = 0's over the same steps, same seeds: per seed the mean
    of reward/mean over all steps minus k = 0's, and the largest difference of a 10-step moving mean; then the mean
    over seeds and the worst seed."""
    by_seed = {row["seed"]: row["reward_per_step"] for row in reference}
    means, windows = [], []
    for row in runs:
        base = by_seed.get(row["seed"])
        if base is None:
            continue
        steps = min(len(base), len(row["reward_per_step"]))
        mine, theirs = row["reward_per_step"][:steps], base[:steps]
        means.append(sum(mine) / steps - sum(theirs) / steps)
        width = min(10, steps)
        windows.append(max(abs(sum(mine[i:i + width]) - sum(theirs[i:i + width])) / width
                           for i in range(steps - width + 1)))
    if not means:
        return {}
    worst = max(means, key=lambda diff: abs(diff))
    return {"mean_diff": round(statistics.mean(means), 4), "worst_seed_mean_diff": round(worst, 4),
            "worst_10_step_window_diff": round(max(windows), 4)}


def warm_start(seed: int, root: Path) -> Path:
    """SFT the arithmetic model as the README's main job does (``hybridflow sft examples/sft_arithmetic.yaml``,
    in process); the HF directory GRPO then starts from."""
    from hybridflow.trainer.cli import fit_and_close
    from hybridflow.trainer.sft import SFTTrainer
    from hybridflow.trainer.sft_config import load_sft_config

    run_dir = root / f"sft-{seed}"
    config = load_sft_config(ROOT / "examples" / "sft_arithmetic.yaml",
                             [f"trainer.run_dir={run_dir}", f"trainer.seed={seed}"])
    return fit_and_close(SFTTrainer(config, progress=False))


def summarize(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per setting: medians over its runs, and its tokens/s as a ratio to split-k0's and colocated's."""
    medians = {setting: {key: statistics.median(row[key] for row in rows) for key in rows[0]
                         if isinstance(rows[0][key], float)} for setting, rows in results.items()}
    k0: str | None = next((name for name in ("split-k0", "split-k0/object_store") if name in results), None)
    out = []
    for setting, values in medians.items():
        row: dict[str, Any] = {"setting": setting, "summary": True, "runs": len(results[setting]), **values}
        for reference in ("split-k0", "split-k0/object_store", "colocated"):
            if reference in medians and reference != setting:
                row[f"tokens_per_s_vs_{reference}"] = values["tokens_per_s"] / medians[reference]["tokens_per_s"]
        if k0 is not None and setting != k0:
            row["reward_gap_vs_k0"] = reward_gap(results[setting], results[k0])
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting per seed, interleaved")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), choices=SETTINGS)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--stream-chunks", type=int, default=4, help="chunks a step of the -stream/-barrier settings")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--partial-tokens", type=int, default=4, help="segment size of the -partial settings")
    parser.add_argument("--colocated-workers", type=int, default=2, help="workers of the colocated pool (split: 1+1)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--weight-sync", nargs="+", default=["object_store"], choices=("object_store", "collective"),
                        help="rollout.weight_sync of the split settings (several: each split setting with each)")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help="the GRPO config every setting starts from")
    parser.add_argument("--warm-start", action="store_true",
                        help="SFT first (examples/sft_arithmetic.yaml, per seed) and start GRPO from it with the exact-"
                             "match reward, as the README's main job: a model that learns within the bench's steps")
    parser.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    args = parser.parse_args()
    args.model_path = None
    init_ray(num_cpus=4, object_store_memory=300_000_000)
    results: dict[str, list[dict[str, Any]]] = {}
    print(f"# load average at start: {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as directory:
        for seed in args.seeds:
            if args.warm_start:
                args.model_path = warm_start(seed, Path(directory))
            for round_index in range(args.rounds):
                shift = round_index % len(args.settings)
                for setting in args.settings[shift:] + args.settings[:shift]:
                    for weight_sync in (args.weight_sync if setting.startswith("split") else ["object_store"]):
                        result = run_setting(setting, seed, args, Path(directory), weight_sync)
                        results.setdefault(result["setting"], []).append(result)
                        results_page.result(result)
    for row in summarize(results):
        results_page.result(row)
    print(f"# load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="Asynchronous RL on a split rollout pool vs the synchronous loops"))
