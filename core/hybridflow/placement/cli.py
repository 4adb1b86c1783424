"""``hybridflow plan``: search a placement and print it, or (``--from-run``) ask the remap advisor about a run.

It parses arguments, prints and writes files; the search, simulator and advisor live in sibling modules, and
``hybridflow train`` reads the fragment it writes.
Stability: experimental.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from hybridflow.errors import HybridflowError
from hybridflow.placement.advisor import ADVISOR_FILE, advise_remap
from hybridflow.placement.dataflow import ALGORITHMS, Workload, get_dataflow
from hybridflow.placement.fragment import build_fragment, validate_fragment
from hybridflow.placement.models import parse_model
from hybridflow.placement.profiles import DEVICE_PROFILES, build_cluster
from hybridflow.placement.record import PLAN_FILE, plan_inputs, save_plan_record
from hybridflow.placement.search import Plan, SearchResult, search_placements

__all__ = ["main", "build_parser", "format_plan"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow plan", description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="ppo", help=f"a registered algorithm: {', '.join(sorted(ALGORITHMS))}, "
                        "rloo, reinforce_plus_plus or a plugin's (its declared roles give its dataflow)")
    parser.add_argument("--model", default="7b", help="every model unless given below: preset (7b, 13b, 34b, 70b, "
                        "tiny), size (1.5b, 350m) or path to a Hugging Face config.json or its folder")
    for role in ("actor", "critic", "reference", "reward", "cost"):
        parser.add_argument(f"--{role}", default=None, help=f"{role} model (default: --model)")
    parser.add_argument("--devices", type=int, default=8, help="total devices")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--profile", default="a100-80gb", help=f"device profile: {', '.join(DEVICE_PROFILES)}")
    parser.add_argument("--device-memory-gb", type=float, default=None, help="override the profile's memory")
    parser.add_argument("--compute-units", type=float, default=None,
                        help="cores the devices share when there are fewer than devices (CPU slots on a small box)")
    parser.add_argument("--batch", type=int, default=1024, help="prompts per iteration")
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--mini-batches", type=int, default=8, help="optimizer steps per epoch")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--top", type=int, default=5, help="runners-up to print")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"folder to write placement.yaml (config fragment) and {PLAN_FILE} into")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--from-run", type=Path, default=None, metavar="RUN_DIR",
                        help=f"run the remap advisor on RUN_DIR ({PLAN_FILE} + ledger.jsonl)")
    parser.add_argument("--remaining", type=int, default=None, help="iterations left in the run (with --from-run)")
    parser.add_argument("--calibrate-with", type=Path, nargs="*", default=[], metavar="RUN_DIR",
                        help="earlier runs (plan.json + ledger.jsonl) the advisor calibrates from too, e.g. one at "
                             "another data-parallel size (with --from-run)")
    return parser


def format_plan(plan: Plan, title: str) -> str:
    """Plain-text block: the placement, each model's layout, and the per-stage schedule."""
    lines = [f"{title}: {plan.describe()}  →  {plan.iteration_seconds:.2f} s/iteration"]
    for role, layout in plan.layouts.items():
        generation = f", generation {layout.generation}" if layout.generation else ""
        lines.append(f"  {role:<10} {layout.devices:>4} devices  {layout.parallel}{generation}")
    lines.append(f"  {'stage':<18}{'set':>4}{'start s':>10}{'seconds':>10}")
    for t in plan.timings:
        lines.append(f"  {t.name:<18}{t.set_index:>4}{t.start:>10.2f}{t.seconds:>10.2f}")
    return "\n".join(lines)


def _print_rich(result: SearchResult) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    console = Console()
    best = result.best
    console.print(f"[bold]Chosen[/bold]: {best.describe()} → [bold]{best.iteration_seconds:.2f} s[/bold]/iteration")
    layouts = Table("model", "devices", "train/infer layout", "generation layout")
    for role, layout in best.layouts.items():
        layouts.add_row(role, str(layout.devices), str(layout.parallel), str(layout.generation or "-"))
    console.print(layouts)
    stages = Table("stage", "set", "start s", "seconds")
    for t in best.timings:
        stages.add_row(t.name, str(t.set_index), f"{t.start:.2f}", f"{t.seconds:.2f}")
    console.print(stages)
    runners = Table("runner-up", "s/iteration", "vs chosen")
    for plan in result.runners_up:
        runners.add_row(plan.describe(), f"{plan.iteration_seconds:.2f}",
                        f"{plan.iteration_seconds / best.iteration_seconds:.2f}×")
    console.print(runners)
    return True


def _print_result(result: SearchResult) -> None:
    if not _print_rich(result):
        print(format_plan(result.best, "Chosen"))
        for plan in result.runners_up:
            print(f"runner-up: {plan.describe()}  {plan.iteration_seconds:.2f} s "
                  f"({plan.iteration_seconds / result.best.iteration_seconds:.2f}×)")
    print(f"searched {result.placements_considered} placements, {result.allocations_evaluated} allocations in "
          f"{result.wall_seconds:.2f} s; {len(result.infeasible)} placements infeasible")


def _run_advisor(args: argparse.Namespace) -> int:
    if args.remaining is None:
        print("hybridflow plan: --from-run needs --remaining N (iterations left).", file=sys.stderr)
        return 2
    recommendation = advise_remap(args.from_run, args.remaining, calibration_runs=args.calibrate_with)
    if args.json:
        print(json.dumps(recommendation.to_json(), indent=2))
    else:
        print(("REMAP: " if recommendation.remap else "KEEP: ") + recommendation.reason)
        if recommendation.calibration:
            print(f"  calibration: {recommendation.calibration}")
        for node, ratio in recommendation.drift.items():
            print(f"  drift {node}: observed/predicted = {ratio:.2f}")
        for key, value in recommendation.transition.items():
            print(f"  transition {key}: {value:.1f}")
        print(f"written to {args.from_run / ADVISOR_FILE}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``hybridflow plan``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.from_run is not None:
            return _run_advisor(args)
        dataflow = get_dataflow(args.algorithm)
        models = {role: parse_model(getattr(args, role, None) or args.model) for role in dataflow.roles}
        cluster = build_cluster(args.profile, args.devices, args.devices_per_node, args.device_memory_gb,
                                compute_units=args.compute_units)
        workload = Workload(prompts=args.batch, samples_per_prompt=args.samples_per_prompt,
                            prompt_length=args.prompt_length, response_length=args.response_length,
                            mini_batches=args.mini_batches, micro_batch_size=args.micro_batch_size)
        inputs = plan_inputs(dataflow.algorithm, models, cluster, workload)
        result = search_placements(inputs.simulator(), dataflow, inputs.models, top=args.top)
        fragment = build_fragment(result.best, cluster)
        validate_fragment(fragment)
    except HybridflowError as exc:
        print(f"hybridflow plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"best": result.best.describe(), "iteration_seconds": result.best.iteration_seconds,
                          "fragment": fragment, "runners_up": [[p.describe(), p.iteration_seconds]
                                                               for p in result.runners_up]}, indent=2))
    else:
        _print_result(result)
        print(yaml.safe_dump(fragment, sort_keys=False, default_flow_style=None), end="")
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "placement.yaml").write_text(yaml.safe_dump(fragment, sort_keys=False, default_flow_style=None))
        save_plan_record(args.output / PLAN_FILE, inputs, result.best)
        print(f"wrote {args.output / 'placement.yaml'} and {args.output / PLAN_FILE}", file=sys.stderr)
    return 0
