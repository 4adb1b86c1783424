"""The python tool's per-call cost under the kernel boundary (``bubblewrap``) against the previous default, the
audit hook with ``unshare`` namespaces (kept as the opt-in ``unisolated`` mode), side by side in one run.

Sequential: ``--calls`` calls of ``print(1)`` per mode, in alternating blocks of 10 so that load drifts hit both
modes alike; reported as the median and p90 call wall time and their ratio. Concurrent: ``--concurrent`` calls that
each sleep 2 s, started together through ``asyncio.gather`` as the agent loop issues them: they overlap when every
call starts before any ends (CLOCK_MONOTONIC is one clock for all processes), and the wall time is reported.

Prints ``RESULT {"mode", "calls", "median_ms", "p90_ms", "concurrent", "concurrent_wall_s", "overlap"}`` per mode
and ``RESULT {"ratio_median", "ratio_p90"}`` (bubblewrap over unisolated); ``--write PATH`` also writes the table
(date, machine, command) to PATH, which docs/benchmarks/tool_sandbox.md is.

Run: ``OMP_NUM_THREADS=1 python bench/tool_sandbox.py [--calls 100] [--concurrent 32] [--write
docs/benchmarks/tool_sandbox.md]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from hybridflow.tools.isolation import IsolationMode, isolation_status
from hybridflow.tools.sandbox import SandboxLimits, namespace_isolation_available, run_sandboxed_python

MODES: tuple[IsolationMode, ...] = ("unisolated", "bubblewrap")


async def one_call(mode: IsolationMode, code: str) -> tuple[float, str]:
    started = time.perf_counter()
    outcome = await run_sandboxed_python(code, timeout_s=60, limits=SandboxLimits(isolation=mode))
    if outcome.returncode != 0:
        raise RuntimeError(f"{mode}: the call failed: {outcome.stderr[-500:]}")
    return time.perf_counter() - started, outcome.stdout


async def concurrent_calls(mode: IsolationMode, count: int) -> tuple[float, bool]:
    code = "import time\nstart = time.monotonic()\ntime.sleep(2)\nprint(start, time.monotonic())"
    started = time.perf_counter()
    results = await asyncio.gather(*[one_call(mode, code) for _ in range(count)])
    wall = time.perf_counter() - started
    spans = [tuple(float(x) for x in stdout.split()) for _, stdout in results]
    return wall, max(start for start, _ in spans) < min(end for _, end in spans)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--write", type=Path, default=None, help="write the results table (markdown) here")
    args = parser.parse_args()
    status = isolation_status()
    if not status.available:
        sys.exit(f"bench/tool_sandbox.py: the kernel boundary is unavailable here: {status.reason}")
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm both (imports, page cache)
        asyncio.run(one_call(mode, "print(1)"))
    block = 10
    for _ in range(0, args.calls, block):
        for mode in MODES:
            for _ in range(block):
                times[mode].append(asyncio.run(one_call(mode, "print(1)"))[0])
    rows = []
    for mode in MODES:
        wall, overlap = asyncio.run(concurrent_calls(mode, args.concurrent))
        row = {"mode": mode, "calls": len(times[mode]), "median_ms": round(1e3 * statistics.median(times[mode]), 1),
               "p90_ms": round(1e3 * percentile(times[mode], 0.9), 1), "concurrent": args.concurrent,
               "concurrent_wall_s": round(wall, 2), "overlap": overlap}
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
    ratio = {"ratio_median": round(rows[1]["median_ms"] / rows[0]["median_ms"], 2),
             "ratio_p90": round(rows[1]["p90_ms"] / rows[0]["p90_ms"], 2)}
    print("RESULT " + json.dumps(ratio), flush=True)
    if args.write is not None:
        command = "OMP_NUM_THREADS=1 python bench/tool_sandbox.py " + " ".join(sys.argv[1:])
        lines = [
            "# The python tool's per-call cost: kernel boundary vs audit hook",
            "",
            "Written by `bench/tool_sandbox.py` (do not edit by hand).",
            "",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
            f"{platform.python_version()}; the sandbox's interpreter: {status.interpreter}",
            f"- command: `{command}`",
            f"- `unisolated` used unshare namespaces: {namespace_isolation_available()}",
            "",
            "| mode | calls of `print(1)` | median ms | p90 ms | concurrent calls of `sleep(2)` | their wall s "
            "| all overlap |",
            "|---|---|---|---|---|---|---|",
            *[f"| {r['mode']} | {r['calls']} | {r['median_ms']} | {r['p90_ms']} | {r['concurrent']} | "
              f"{r['concurrent_wall_s']} | {r['overlap']} |" for r in rows],
            "",
            f"bubblewrap / unisolated: median {ratio['ratio_median']}x, p90 {ratio['ratio_p90']}x.",
            "",
        ]
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
