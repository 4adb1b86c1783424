"""Record (or check) the metrics of a short seeded run, to show that a refactor changes no number.

The run is ``examples/grpo_arithmetic_scratch.yaml`` for three steps, as configured (lookahead, balancing, padding
removal, mixed precision ``auto``), on this box's two CPU workers; the metrics kept are the ones a run computes from
its numbers (rewards, losses, KL, entropy, clip fractions, lengths, grad norms, ...), not the ones it measures
(seconds, throughput, memory). ``tests/e2e/test_golden_run.py`` runs the same job on the current code and requires
every kept metric equal bit for bit to ``tests/data/golden_grpo_scratch.json``.

    .venv/bin/python scripts/record_golden_run.py tests/data/golden_grpo_scratch.json   # re-record

Re-record only when a change is meant to change the numbers, and say so in its commit.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arithmetic_scratch.yaml"
OVERRIDES = ["trainer.total_steps=3", "trainer.checkpoint_every=0", "trainer.tensorboard=false",
             "trainer.resume=never", "trainer.log_rollouts=0", "trainer.val_every=0", "trainer.val_n=1",
             "data.task.num_val_prompts=0"]
#: measured, not computed: left out of the comparison
MEASURED = re.compile(r"(^time/|^timing_s/|^timing_per_token_ms/|^throughput/|^perf/|memory|_seconds|_s$|"
                      r"^async/.*(busy|wait|load)|^process/)")


def computed(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in sorted(metrics.items()) if not MEASURED.search(key)}


def run_job(run_dir: Path) -> list[dict[str, float]]:
    """Run the job in a fresh interpreter (the code it imports is the caller's environment's) and read its rows."""
    command = [sys.executable, "-m", "hybridflow.cli", "train", "--no-progress", str(EXAMPLE),
               f"trainer.run_dir={run_dir}", *OVERRIDES]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return _rows(run_dir)


def _rows(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [computed({k: v for k, v in row.items() if k != "step"}) for row in rows if "reward/mean" in row]


def worker_pids(run_dir: Path) -> list[int]:
    """The pid of every rank of every pool the run's manifest records (its placement section)."""
    placement = json.loads((run_dir / "manifest.json").read_text())["placement"]
    return [rank["pid"] for pool in sorted(placement) for rank in placement[pool]["ranks"]]


def run_jobs_in_one_driver(run_dirs: list[Path]) -> list[list[dict[str, float]]]:
    """Run the job once per run dir, one after another in one fresh interpreter (``hybridflow train`` called in a
    loop, as a notebook or a sweep does: the later runs start on the worker processes the earlier ones parked,
    hybridflow.controller.park), and read each run's rows."""
    runs = [["train", "--no-progress", str(EXAMPLE), f"trainer.run_dir={run_dir}", *OVERRIDES] for run_dir in run_dirs]
    code = ("import json, sys\nfrom hybridflow.cli import main\n"
            "for argv in json.loads(sys.argv[1]):\n    code = main(argv)\n    if code:\n        sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(runs)], capture_output=True, text=True,
                            timeout=1200, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{len(runs)} runs of {EXAMPLE.name} in one driver failed ({result.returncode}):\n"
                           f"{result.stderr[-4000:]}")
    return [_rows(run_dir) for run_dir in run_dirs]


def machine() -> str:
    """What decides the bits of a float kernel's result: the CPU model and its vector ISA (MKL and oneDNN pick their
    kernels and blocking by it), e.g. ``Intel(R) Xeon(R) Processor; avx512bw avx512f amx_bf16 ...``."""
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = {flag for flag in value.split() if flag.startswith(("avx", "amx", "fma", "sse4"))}
                break
    return f"{model}; {' '.join(sorted(flags))}"


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "tests" / "data" / "golden_grpo_scratch.json"
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_job(Path(tmp) / "run")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    out.write_text(json.dumps({"recorded_at_commit": commit, "command": f"scripts/record_golden_run.py {out}",
                               "machine": machine(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}: {len(rows)} rows, {len(rows[0]) if rows else 0} metrics each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
