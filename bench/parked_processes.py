"""Runs one after another in one driver, with parked worker processes (hybridflow.controller.park) and without.

A notebook or a sweep calls ``hybridflow train`` (here: ``hybridflow.cli.main``) several times in one Python process.
Each mode runs ``--runs`` short jobs of the shipped scratch GRPO config in a fresh driver process of its own: with
parking (the default) the later runs start on the processes the first one parked; with ``HYBRIDFLOW_REUSE_WORKERS=0``
every run starts its own. The modes alternate ``--rounds`` times, so load drifts hit both alike.

Per round and mode it reports the wall seconds of the first run and the mean of the later ones (inside the driver,
around each ``main`` call), and the machine's CPU-seconds over the whole driver process (every process on the box,
read from /proc/stat: the Ray and worker processes included, so keep the box otherwise idle); then the ratios
without / with parking over all rounds.

Run: ``OMP_NUM_THREADS=1 python bench/parked_processes.py [--runs 3] [--steps 2] [--rounds 2]``; the page is
docs/benchmarks/parked_processes.md (``--no-write``: print the RESULT lines only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

import results_page

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"
TITLE = "Runs in one driver: parked worker processes against fresh ones"
DRIVER = """
import json, sys, time
from hybridflow.cli import main
walls = []
for argv in json.loads(sys.argv[1]):
    started = time.perf_counter()
    code = main(argv)
    walls.append(time.perf_counter() - started)
    if code:
        sys.exit(code)
print("WALLS " + json.dumps(walls))
"""


def machine_cpu_seconds() -> float:
    """user + nice + system time of every CPU since boot (/proc/stat's first line)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return sum(int(value) for value in fields[1:4]) / os.sysconf("SC_CLK_TCK")


def _pids(run_dir: Path) -> list[int]:
    """Every rank's pid, as the run's manifest records it."""
    placement = json.loads((run_dir / "manifest.json").read_text())["placement"]
    return [rank["pid"] for pool in sorted(placement) for rank in placement[pool]["ranks"]]


def one_driver(reuse: bool, runs: int, steps: int, workdir: Path) -> dict[str, float]:
    overrides = [f"trainer.total_steps={steps}", "trainer.checkpoint_every=0", "trainer.tensorboard=false",
                 "trainer.resume=never", "trainer.val_every=0", "data.task.num_val_prompts=0"]
    argvs = [["train", "--no-progress", str(EXAMPLE), f"trainer.run_dir={workdir / f'run{index}'}", *overrides]
             for index in range(runs)]
    env = {**os.environ, "HYBRIDFLOW_REUSE_WORKERS": "1" if reuse else "0"}
    before = machine_cpu_seconds()
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                            env=env, timeout=3600, check=False)
    cpu = machine_cpu_seconds() - before
    if result.returncode != 0:
        raise RuntimeError(f"the driver failed ({result.returncode}):\n{result.stderr[-3000:]}")
    walls = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("WALLS "))[6:])
    pids = [_pids(workdir / f"run{index}") for index in range(runs)]
    reused = all(run_pids == pids[0] for run_pids in pids)
    return {"first_run_s": round(walls[0], 2), "later_runs_mean_s": round(mean(walls[1:]), 2),
            "driver_wall_s": round(sum(walls), 2), "machine_cpu_s": round(cpu, 1), "same_pids": reused}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per driver (at least 2)")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="times each mode runs, alternating")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 (the later runs are the point), got {args.runs}")
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for reuse in (True, False) if round_ % 2 == 0 else (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                row = one_driver(reuse, args.runs, args.steps, Path(tmp))
            rows[reuse].append(row)
            results_page.result({"round": round_, "parking": "on" if reuse else "off", "runs": args.runs,
                                 "steps": args.steps, **row})
    on, off = rows[True], rows[False]
    results_page.result({
        "later_run_s_off_over_on": round(mean(r["later_runs_mean_s"] for r in off)
                                         / mean(r["later_runs_mean_s"] for r in on), 2),
        "machine_cpu_s_off_over_on": round(mean(r["machine_cpu_s"] for r in off)
                                           / mean(r["machine_cpu_s"] for r in on), 2),
        "driver_wall_s_off_over_on": round(mean(r["driver_wall_s"] for r in off)
                                           / mean(r["driver_wall_s"] for r in on), 2),
        "parked_runs_reused_pids": all(r["same_pids"] for r in on),
        "fresh_runs_reused_pids": any(r["same_pids"] for r in off)})
    return 0


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title=TITLE, description=(
        "Each row is one driver process running the scratch GRPO config `runs` times in a row "
        "(`hybridflow.cli.main`); `same_pids`: every run's ranks had the first run's pids. The last row: the ratios "
        "of the means, parking off over on.")))
