"""Gloo ranks started from a forkserver that imported torch and transformers, against spawned fresh interpreters.

The contract suites and the plugin tests run their N-rank checks through ``hybridflow.testing.contracts.run_ranks``,
whose ranks start from ``hybridflow.controller.preloaded``'s forkserver (``HYBRIDFLOW_FORKSERVER=0``: spawned).
Each mode runs in a fresh driver process of its own: ``--runs`` times two ranks that build the tiny Qwen2 preset,
take one training step and all-reduce its gradients (what a data-parallel contract check does, smaller). The modes
alternate ``--rounds`` times.

Per round and mode: the driver's wall seconds for all runs, and the CPU-seconds the ranks used (each rank reports
its own ``time.process_time()`` as it ends; the forkserver's own CPU, its one-time imports, is read from /proc and
added), so the numbers hold on a loaded box too. Then the ratios spawned / forked.

Run: ``OMP_NUM_THREADS=1 python bench/preloaded_processes.py [--runs 4] [--rounds 2]``; the page is
docs/benchmarks/preloaded_processes.md (``--no-write``: print the RESULT lines only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import mean

import results_page

TITLE = "Gloo ranks forked from a preloaded forkserver against spawned interpreters"
DRIVER = """
import json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from preloaded_processes import one_rank
from hybridflow.testing.contracts.spawn import run_ranks

runs = int(sys.argv[1])
started = time.perf_counter()
cpu = []
with tempfile.TemporaryDirectory() as tmp:
    for run in range(runs):
        out = Path(tmp) / str(run)
        out.mkdir()
        run_ranks(one_rank, 2, str(out), workdir=out, timeout_s=600)
        cpu.extend(float((out / f"cpu{rank}").read_text()) for rank in range(2))
wall = time.perf_counter() - started
server = 0.0
from multiprocessing import forkserver
pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
if pid:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
print("RESULT_DRIVER " + json.dumps({"wall_s": wall, "rank_cpu_s": sum(cpu), "server_cpu_s": server}))
"""


def one_rank(rank: int, world_size: int, out: str) -> None:
    """Build the tiny Qwen2 preset, one SGD step on a random batch, gradients all-reduced; report this process's CPU."""
    import time

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.presets import preset_model_config

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**preset_model_config("tiny-qwen2")))
    ids = torch.randint(4, 40, (4, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
    Path(out, f"cpu{rank}").write_text(str(time.process_time()))


def one_driver(forked: bool, runs: int) -> dict[str, float]:
    env = {**os.environ, "HYBRIDFLOW_FORKSERVER": "1" if forked else "0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", DRIVER, str(runs), str(Path(__file__).parent)],
                            capture_output=True, text=True, env=env, timeout=3600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the driver failed ({result.returncode}):\n{result.stderr[-3000:]}")
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT_DRIVER "))[14:])
    return {"wall_s": round(row["wall_s"], 2), "rank_cpu_s": round(row["rank_cpu_s"], 2),
            "forkserver_cpu_s": round(row["server_cpu_s"], 2),
            "cpu_s": round(row["rank_cpu_s"] + row["server_cpu_s"], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="2-rank runs per driver")
    parser.add_argument("--rounds", type=int, default=2, help="times each mode runs, alternating")
    args = parser.parse_args()
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for forked in (True, False) if round_ % 2 == 0 else (False, True):
            row = one_driver(forked, args.runs)
            rows[forked].append(row)
            results_page.result({"round": round_, "ranks": "forked" if forked else "spawned", "runs": args.runs,
                                 **row})
    forked, spawned = rows[True], rows[False]
    results_page.result({
        "cpu_s_spawned_over_forked": round(mean(r["cpu_s"] for r in spawned) / mean(r["cpu_s"] for r in forked), 2),
        "wall_s_spawned_over_forked": round(mean(r["wall_s"] for r in spawned)
                                            / mean(r["wall_s"] for r in forked), 2),
        "rank_cpu_s_per_rank_spawned": round(mean(r["rank_cpu_s"] for r in spawned) / (2 * args.runs), 2),
        "rank_cpu_s_per_rank_forked": round(mean(r["rank_cpu_s"] for r in forked) / (2 * args.runs), 2)})
    return 0


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title=TITLE, description=(
        "Each row is one driver process running `runs` two-rank jobs through `run_ranks` (each rank: build the "
        "tiny Qwen2 preset, one step, gradients all-reduced). `cpu_s`: the ranks' own CPU-seconds plus the "
        "forkserver's (its imports, once per driver). The last row: the ratios of the means, spawned over forked.")))
