"""The README's main job as a user runs it — `hybridflow sft examples/sft_arithmetic.yaml` then `hybridflow train
examples/grpo_arithmetic.yaml`, two CLI processes — timed, and optionally run ``--factor`` times longer (GRPO's
``trainer.total_steps`` × factor, everything else as shipped) to check that it keeps learning instead of collapsing.

Per seed (``trainer.seed`` of both commands; the task's train/held-out split stays the shipped one) it prints one
``RESULT`` line:

- ``sft_s`` / ``grpo_s`` / ``total_s``: wall seconds of each command (Ray start-up and worker start included);
- ``all_zero_adv_step_share``: the share of GRPO steps where *every* group had all rewards equal
  (``critic/zero_adv_group_ratio`` == 1: zero advantage everywhere, no gradient — the collapse the issue reported at
  523 of 600 steps), and ``zero_adv_group_ratio_mean`` / ``..._last_quarter`` the mean share of such groups;
- ``val_greedy`` / ``val_mean8``: the held-out curve (``val-core/hybridflow/arithmetic/acc/mean@1`` and ``mean@8``)
  at every validation, ``val_mean8_at_shipped_end`` its value at the shipped length (step 400), and
  ``val_mean8_last_quarter`` the mean over the last quarter of the validations;
- ``checks``: ``no_collapse`` (all-zero-advantage steps < 10%), ``val_holds`` (last-quarter mean@8 ≥ the value at the
  shipped end − 0.05, i.e. the held-out accuracy does not fall when training runs on), ``rises`` (mean@8 at the
  shipped end ≥ the value at step 0 + 0.2) and, with ``--budget-s``, ``within_budget`` (SFT + GRPO wall time at factor
  1 within it; the issue's target is 5 minutes on the 2-core box).

The script exits 1 when any check fails. Run: ``python bench/main_job.py [--factor 10] [--seeds 0 1]
[--budget-s 300]`` from the repository root (or anywhere: it runs in a temporary copy of the two configs' outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import results_page

ROOT = Path(__file__).resolve().parents[1]
VAL_GREEDY = "val-core/hybridflow/arithmetic/acc/mean@1"
VAL_MEAN8 = "val-core/hybridflow/arithmetic/acc/mean@8"
SHIPPED_STEPS = 400


def _run(argv: list[str], cwd: Path, log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}); its output is in {log}")
    return time.perf_counter() - start


def run_seed(seed: int, factor: int, work: Path, overrides: list[str]) -> dict[str, Any]:
    cli = [sys.executable, "-m", "hybridflow.cli"]
    sft_dir, grpo_dir = work / f"sft-{seed}", work / f"grpo-{seed}"
    sft_s = _run([*cli, "sft", str(ROOT / "examples/sft_arithmetic.yaml"), f"trainer.run_dir={sft_dir}",
                  f"trainer.seed={seed}", "trainer.progress=false"], ROOT, work / f"sft-{seed}.log")
    steps = SHIPPED_STEPS * factor
    grpo_s = _run([*cli, "train", str(ROOT / "examples/grpo_arithmetic.yaml"), f"model.path={sft_dir / 'hf'}",
                   f"trainer.run_dir={grpo_dir}", f"trainer.seed={seed}", f"trainer.total_steps={steps}",
                   f"trainer.checkpoint_every={max(100, steps // 4)}", "trainer.progress=false",
                   "trainer.resume=never", *overrides], ROOT, work / f"grpo-{seed}.log")
    records = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "critic/zero_adv_group_ratio" in r]
    val = sorted((r for r in records if VAL_MEAN8 in r), key=lambda r: r["step"])
    if len(train) != steps or not val:
        raise SystemExit(f"seed {seed}: expected {steps} training records and validations in {grpo_dir}, "
                         f"got {len(train)} and {len(val)}")
    zero = [r["critic/zero_adv_group_ratio"] for r in train]
    mean8 = {int(r["step"]): r[VAL_MEAN8] for r in val}
    last_quarter = [r[VAL_MEAN8] for r in val[-max(1, len(val) // 4):]]
    at_end = mean8.get(SHIPPED_STEPS, val[-1][VAL_MEAN8])
    result: dict[str, Any] = {
        "seed": seed, "factor": factor, "overrides": overrides, "steps": steps, "sft_s": round(sft_s, 1),
        "grpo_s": round(grpo_s, 1),
        "total_s": round(sft_s + grpo_s, 1), "s_per_step": round(grpo_s / steps, 3),
        "all_zero_adv_step_share": sum(z >= 1.0 for z in zero) / len(zero),
        "zero_adv_group_ratio_mean": round(mean(zero), 3),
        "zero_adv_group_ratio_last_quarter": round(mean(zero[-len(zero) // 4:]), 3),
        "reward_first_25": round(mean(r["reward/mean"] for r in train[:25]), 3),
        "reward_last_25": round(mean(r["reward/mean"] for r in train[-25:]), 3),
        "entropy_last_25": round(mean(r["actor/entropy"] for r in train[-25:]), 3),
        "val_steps": [int(r["step"]) for r in val],
        "val_greedy": [round(r[VAL_GREEDY], 3) for r in val],
        "val_mean8": [round(r[VAL_MEAN8], 3) for r in val],
        "val_mean8_at_shipped_end": round(at_end, 3),
        "val_mean8_last_quarter": round(mean(last_quarter), 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    checks = {"no_collapse": result["all_zero_adv_step_share"] < 0.10,
              "rises": at_end >= val[0][VAL_MEAN8] + 0.2}
    if factor > 1:
        checks["val_holds"] = result["val_mean8_last_quarter"] >= at_end - 0.05
    result["checks"] = checks
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=int, default=1, help="GRPO steps = 400 × factor (10: the issue's 10× run)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--budget-s", type=float, default=None, help="check SFT + GRPO wall time (factor 1 only)")
    parser.add_argument("--override", action="append", default=[],
                        help="an extra `hybridflow train` override (repeatable), e.g. trainer.seed=1")
    parser.add_argument("--keep", type=Path, default=None, help="write the runs here instead of a temporary dir")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ok = True
    with tempfile.TemporaryDirectory(prefix="hf-main-job-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            result = run_seed(seed, args.factor, work, args.override)
            if args.budget_s is not None and args.factor == 1:
                result["checks"]["within_budget"] = result["total_s"] <= args.budget_s
            ok = ok and all(result["checks"].values())
            results_page.result(result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="The README's main job (SFT then GRPO) as CLI processes"))
