"""``hybridflow report RUN_DIR``: PNG plots (reward curve, validation curve, per-step time by node), a short text
summary with the run's capacity (policy updates per hour; samples, generated tokens and device-seconds per update),
and ``report.html``: the plots, the numbers and a table of the decoded samples in ``rollouts.jsonl``.

It reads ``metrics.jsonl``, ``ledger.jsonl``, ``rollouts.jsonl`` and ``manifest.json``; it never touches a running
job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hybridflow.ledger import read_ledger
from hybridflow.report_html import render_html
from hybridflow.trainer.capacity import (
    advise_placement,
    compute_capacity,
    format_capacity,
    format_verdict,
    read_run_config,
)
from hybridflow.trainer.progress import read_metrics

__all__ = ["main", "summarize_run", "render_plots", "render_html", "split_validation_rows"]

VALIDATION_PREFIXES = ("val-core/", "val-aux/")


def split_validation_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, validation rows) of metrics.jsonl: a validation row holds only ``val-*`` metrics (and its
    timing), written at the policy version it evaluated."""
    validation = [row for row in rows if any(key.startswith(VALIDATION_PREFIXES) for key in row)]
    training = [row for row in rows if not any(key.startswith(VALIDATION_PREFIXES) for key in row)]
    return training, validation


def _validation_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each ``val-core`` metric's first and last value and the steps they were measured at."""
    out: dict[str, dict[str, float]] = {}
    for key in sorted({k for row in rows for k in row if k.startswith("val-core/")}):
        points = [(row["step"], row[key]) for row in rows if key in row]
        out[key] = {"first_step": points[0][0], "first": points[0][1], "last_step": points[-1][0],
                    "last": points[-1][1], "best": max(value for _, value in points)}
    return out


def _node_seconds(node: dict[str, Any]) -> float:
    """A node's own run time (``busy_seconds``) when recorded; dispatch-to-collection ``seconds`` otherwise (that
    includes queueing, e.g. a generation submitted ahead waiting for the update before it)."""
    busy = node.get("busy_seconds")
    return float(busy) if busy else float(node.get("seconds", 0.0))


def summarize_run(run_dir: str | Path, *, remaining: int | None = None) -> dict[str, Any]:
    """Headline numbers of a run: steps, reward trajectory, time per node, capacity, validation and, when the run
    recorded a plan, the placement advisor's verdict."""
    run_dir = Path(run_dir)
    metrics, validation = split_validation_rows(read_metrics(run_dir))
    ledger = read_ledger(run_dir)
    if not metrics:
        from hybridflow.errors import HybridflowError

        raise HybridflowError(f"{run_dir} has no metrics.jsonl: is it a hybridflow run directory?")
    rewards = [m.get("reward/mean", 0.0) for m in metrics]
    head = rewards[: max(1, len(rewards) // 10)]
    tail = rewards[-max(1, len(rewards) // 10):]
    # steps timed end to end (with trainer.lookahead a step's generation starts inside the step before it, so the
    # ledger rows' own spans would undercount)
    seconds = sum(m.get("time/step_s", 0.0) for m in metrics) or sum(row["seconds"] for row in ledger)
    node_seconds: dict[str, float] = {}
    for row in ledger:
        for name, node in row["nodes"].items():
            node_seconds[name] = node_seconds.get(name, 0.0) + _node_seconds(node)
    edge_bytes = sum(edge["bytes"] for row in ledger for edge in row["edges"])
    return {
        "steps": len(metrics),
        "reward_first": sum(head) / len(head),
        "reward_last": sum(tail) / len(tail),
        "reward_best": max(rewards),
        "seconds": seconds,
        "policy_updates_per_hour": len(metrics) / seconds * 3600 if seconds else 0.0,
        "node_seconds": dict(sorted(node_seconds.items(), key=lambda kv: -kv[1])),
        "bytes_moved": edge_bytes,
        "validation": _validation_summary(validation),
        "capacity": compute_capacity(metrics, read_run_config(run_dir)),
        "advisor": advise_placement(run_dir, remaining),
    }


def render_plots(run_dir: str | Path) -> list[Path]:
    """Write ``reward.png``, ``validation.png`` (when the run validated) and ``time_by_node.png`` into the run
    directory; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics, validation = split_validation_rows(read_metrics(run_dir))
    ledger = read_ledger(run_dir)
    paths = []
    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [m["step"] for m in metrics]
    axis.plot(steps, [m.get("reward/mean", 0.0) for m in metrics], label="reward/mean")
    if any("reward/max" in m for m in metrics):
        axis.plot(steps, [m.get("reward/max", 0.0) for m in metrics], alpha=0.4, label="reward/max")
    axis.set_xlabel("step")
    axis.set_ylabel("reward")
    axis.legend()
    axis.set_title(f"reward — {run_dir.name}")
    figure.tight_layout()
    paths.append(run_dir / "reward.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    if validation:
        paths.append(_plot_validation(run_dir, validation, plt))
    if ledger:
        names = sorted({name for row in ledger for name in row["nodes"]})
        figure, axis = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(ledger)
        x = [row["iteration"] for row in ledger]
        for name in names:
            values = [_node_seconds(row["nodes"][name]) if name in row["nodes"] else 0.0 for row in ledger]
            axis.bar(x, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
        axis.plot(x, [row["seconds"] for row in ledger], color="black", linewidth=1, label="iteration wall time")
        axis.set_xlabel("iteration")
        axis.set_ylabel("seconds")
        axis.legend(fontsize=7)
        axis.set_title("time per step by node")
        figure.tight_layout()
        paths.append(run_dir / "time_by_node.png")
        figure.savefig(paths[-1], dpi=100)
        plt.close(figure)
    return paths


def _plot_validation(run_dir: Path, rows: list[dict[str, Any]], plt: Any) -> Path:
    """The ``val-core`` curves (greedy accuracy, mean@k, pass@k per data source) over policy versions."""
    figure, axis = plt.subplots(figsize=(7, 4))
    # acc/best@k/mean is acc/pass@k under verl's name: one curve for both
    for key in sorted({k for row in rows for k in row if k.startswith("val-core/") and "/acc/best@" not in k}):
        points = [(row["step"], row[key]) for row in rows if key in row]
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o", label=key.removeprefix("val-core/"))
    axis.set_xlabel("step (policy updates)")
    axis.set_ylabel("validation")
    axis.set_ylim(-0.02, 1.02)
    axis.legend(fontsize=7)
    axis.set_title(f"validation — {run_dir.name}")
    figure.tight_layout()
    path = run_dir / "validation.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow report", description="Plot and summarise a run directory.")
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--remaining", type=int, default=None,
                        help="iterations the placement advisor weighs a remap over (default: trainer.total_steps)")
    parser.add_argument("--samples", type=int, default=200, help="most recent rollout samples in the HTML table")
    args = parser.parse_args(argv)
    from hybridflow.errors import HybridflowError

    try:
        summary = summarize_run(args.run_dir, remaining=args.remaining)
        plots = render_plots(args.run_dir)
        page = render_html(args.run_dir, summary, plots, samples=args.samples)
    except HybridflowError as exc:
        print(f"hybridflow report: {exc}")
        return 2
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"run {args.run_dir}: {summary['steps']} steps in {summary['seconds']:.1f} s "
          f"({summary['policy_updates_per_hour']:.0f} policy updates/hour)")
    print(f"reward: {summary['reward_first']:.3f} (first 10%) → {summary['reward_last']:.3f} (last 10%), "
          f"best {summary['reward_best']:.3f}")
    print("time by node: " + ", ".join(f"{k} {v:.1f}s" for k, v in list(summary["node_seconds"].items())[:6]))
    for key, curve in summary["validation"].items():
        print(f"{key}: {curve['first']:.3f} (step {curve['first_step']:.0f}) → {curve['last']:.3f} "
              f"(step {curve['last_step']:.0f}), best {curve['best']:.3f}")
    print(f"bytes moved between nodes: {summary['bytes_moved'] / 1e6:.1f} MB")
    print(format_capacity(summary["capacity"]))
    if summary["advisor"] is not None:
        print(format_verdict(summary["advisor"]))
    print("plots: " + ", ".join(str(p) for p in plots))
    print(f"page: {page}")
    return 0
