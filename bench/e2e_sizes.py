"""GRPO throughput per model size: hybridflow's rank/thread configurations vs TRL's GRPOTrainer, side by side.

The fixture, the subprocess per run and the step/token accounting are ``bench/e2e_grpo.py``'s (imported from
there); only the model size and the configurations vary. For each model size of ``--sizes`` (:data:`SIZES`) — the
77K fixture, ~2.4M (hidden 256, intermediate 512, 4 layers, 8 / 4 heads) and ~20M (hidden 512, intermediate 1024,
8 layers, 8 / 4 heads), the fixture otherwise unchanged — hybridflow's default configuration (``hybridflow``: two
FSDP ranks of 1 thread, as the README's main job runs), its single-rank configurations (``hybridflow_1rank``: one
unsharded rank of 1 thread; ``hybridflow_1rank_2threads``: of 2 threads) and TRL with 1 and 2 threads, each in its
own subprocess, with fewer steps the larger the model (:data:`SIZES`). One ``RESULT {json}`` line per size gives
each system's tokens/s and s/step, the ratios (default vs TRL at its better thread count, default vs the best single
rank, ...) and peak RSS per process (driver and each worker for hybridflow — Ray's own daemons not counted — the
one process for TRL). ``--repeats`` rounds per size (3 by default; ``--repeats 1`` for one pass): 2.4M alone took
~18 minutes at 3 rounds on a loaded 2-core box; an idle full run was not timed.

Run: ``.venv/bin/python bench/e2e_sizes.py`` (every size) or ``bench/e2e_sizes.py --sizes 2.4m,20m``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import results_page
from e2e_fixture import NEW_TOKENS, PROMPTS, SAMPLES, SIZES, model_config_of
from e2e_grpo import add_shared_arguments, run_rounds, trl_available

#: the systems of each size: name → (system run by ``--run-one``, hybridflow workers, torch threads per process).
#: hybridflow runs its defaults (``mixed_precision: auto``: bf16 from 1M parameters on a CPU with native bf16).
#: TRL runs in fp32 and in bf16 autocast (its GRPOConfig default), 1 and 2 threads, without activation checkpointing
#: (on by TRL's default, it only recomputes at these sizes: ``trl_defaults_2threads`` is TRL's defaults as shipped);
#: ``trl_best`` is the fastest TRL row.
GRID_SYSTEMS: dict[str, tuple[str, int, int]] = {
    "hybridflow": ("hybridflow", 2, 1),
    "hybridflow_1rank": ("hybridflow", 1, 1),
    "hybridflow_1rank_2threads": ("hybridflow", 1, 2),
    "trl": ("trl", 0, 1),
    "trl_2threads": ("trl", 0, 2),
    "trl_bf16": ("trl", 0, 1),
    "trl_bf16_2threads": ("trl", 0, 2),
    "trl_defaults_2threads": ("trl", 0, 2),
}
#: TRL's precision and activation checkpointing per row (``--trl-bf16``, ``--trl-gradient-checkpointing``)
TRL_OPTIONS: dict[str, dict[str, bool]] = {
    "trl": {"trl_bf16": False, "trl_gradient_checkpointing": False},
    "trl_2threads": {"trl_bf16": False, "trl_gradient_checkpointing": False},
    "trl_bf16": {"trl_bf16": True, "trl_gradient_checkpointing": False},
    "trl_bf16_2threads": {"trl_bf16": True, "trl_gradient_checkpointing": False},
    "trl_defaults_2threads": {"trl_bf16": True, "trl_gradient_checkpointing": True},
}


def run_grid(args: argparse.Namespace) -> None:
    """Every system of :data:`GRID_SYSTEMS` at every size of ``--sizes``, ``--repeats`` rounds per size (the order
    reversed every other round); one ``RESULT`` line per size."""
    sizes = [size.strip() for size in args.sizes.split(",") if size.strip()]
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; known: {list(SIZES)}")
    systems = list(GRID_SYSTEMS)
    why = trl_available(args)
    if why:
        systems = [name for name in systems if GRID_SYSTEMS[name][0] != "trl"]
        print(f"NOTE {why}; printing hybridflow numbers only", file=sys.stderr)
    for size in sizes:
        notes = [why] if why else []
        plans = {name: (system, argparse.Namespace(**{**vars(args), "size": size, "steps": SIZES[size]["steps"],
                                                     "workers": workers or 1, "threads": threads,
                                                     **TRL_OPTIONS.get(name, {})}))
                 for name, (system, workers, threads) in GRID_SYSTEMS.items() if name in systems}
        runs, loads = run_rounds(plans, args.repeats, SIZES[size]["warmup"], notes, label=f"{size} ")
        results_page.result(summarize_size(size, runs, notes, loads))


def summarize_size(size: str, runs: dict[str, list[dict[str, Any]]], notes: list[str],
                   loads: list[float]) -> dict[str, Any]:
    """One size's RESULT: per system its tokens/s, s/step, peak RSS, configuration; then the ratios."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = model_config_of(size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    parameters = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "size": size, "parameters": parameters, "model": SIZES[size]["model"],
        "fixture": {"prompts": PROMPTS, "samples": SAMPLES, "new_tokens": NEW_TOKENS, "steps": SIZES[size]["steps"],
                    "warmup": SIZES[size]["warmup"]},
        "load_avg_1m": {"min": min(loads, default=0.0), "max": max(loads, default=0.0), "cpus": os.cpu_count()},
        "systems": {}}
    rates: dict[str, float] = {}
    for name, system_runs in runs.items():
        if not system_runs:
            continue
        system, workers, threads = GRID_SYSTEMS[name]
        rates[name] = statistics.median(r["summary"]["prompt_response_tokens_per_s"] for r in system_runs)
        result["systems"][name] = {
            "prompt_response_tokens_per_s": round(rates[name], 1),
            "step_s_median": round(statistics.median(r["summary"]["step_s_median"] for r in system_runs), 4),
            "tokens_per_s_per_run": [round(r["summary"]["prompt_response_tokens_per_s"]) for r in system_runs],
            "peak_rss_mib": {key: ([round(v / 2**20) for v in value] if isinstance(value, list)
                                   else round(value / 2**20))
                             for key, value in system_runs[-1]["peak_rss_bytes"].items()},
            "processes": workers + 1 if system == "hybridflow" else 1, "threads_per_process": threads,
            **({"trl_options": TRL_OPTIONS[name]} if name in TRL_OPTIONS else
               {"mixed_precision": system_runs[-1].get("config", {}).get("mixed_precision")}),
            "reward_first_to_last": [system_runs[-1]["rewards"][0], system_runs[-1]["rewards"][-1]]
            if system_runs[-1]["rewards"] else [],
        }
    trl_best = max((name for name in rates if name.startswith("trl")), key=rates.__getitem__, default=None)
    single_best = max((name for name in rates if name.startswith("hybridflow_1rank")), key=rates.__getitem__,
                      default=None)
    ratios: dict[str, Any] = {}
    if trl_best:
        ratios["trl_best"] = trl_best
        for name in rates:
            if not name.startswith("trl"):
                ratios[f"{name}_vs_trl_best"] = round(rates[name] / rates[trl_best], 3)
    if single_best and "hybridflow" in rates:
        ratios["single_rank_best"] = single_best
        ratios["two_ranks_vs_single_rank_best"] = round(rates["hybridflow"] / rates[single_best], 3)
        if "hybridflow_1rank" in rates:
            ratios["two_ranks_vs_one_rank_1thread"] = round(rates["hybridflow"] / rates["hybridflow_1rank"], 3)
    result["ratios"] = ratios
    if notes:
        result["notes"] = notes
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="77k,2.4m,20m",
                        help=f"comma-separated model sizes of {list(SIZES)} (default: all); the steps, warmup, "
                             f"workers and threads of each run are per size and system ({list(GRID_SYSTEMS)})")
    add_shared_arguments(parser)
    parser.set_defaults(deepspeed_zero_stage=0)  # read by launch(); the grid runs no deepspeed system
    run_grid(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(results_page.run(main, title="GRPO throughput per model size: hybridflow vs TRL"))
