"""``RUN_DIR/report.html``: one self-contained page (plots inlined as PNG data, no scripts, no network) with the
run's headline numbers, its capacity, the validation curves and a table of the decoded samples in rollouts.jsonl.

The numbers and plots come from :mod:`hybridflow.report`; this module only lays them out.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from hybridflow.trainer.rollouts import read_rollouts

__all__ = ["render_html", "SAMPLE_COLUMNS", "REPORT_FILE"]

REPORT_FILE = "report.html"
#: (rollouts.jsonl key, column heading) of the sample table, in order
SAMPLE_COLUMNS = (("step", "step"), ("data_source", "data source"), ("prompt", "prompt"), ("response", "response"),
                  ("ground_truth", "ground truth"), ("reward", "reward"), ("advantage", "advantage"),
                  ("length", "length"))

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.text { font-family: ui-monospace, monospace; white-space: pre-wrap; max-width: 40em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
"""


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _numbers_table(rows: list[tuple[str, str]], table_id: str) -> str:
    body = "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td></tr>" for name, value in rows)
    return f'<table id="{table_id}"><tbody>{body}</tbody></table>'


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("steps", str(summary["steps"])), ("wall time of the steps", f"{summary['seconds']:.1f} s"),
            ("reward/mean, first 10% of steps", f"{summary['reward_first']:.3f}"),
            ("reward/mean, last 10% of steps", f"{summary['reward_last']:.3f}"),
            ("best reward/mean", f"{summary['reward_best']:.3f}"),
            ("bytes moved between nodes", f"{summary['bytes_moved'] / 1e6:.1f} MB")]
    rows += [(f"time in {name}", f"{seconds:.1f} s") for name, seconds in list(summary["node_seconds"].items())[:8]]
    return rows


def _capacity_rows(capacity: dict[str, float]) -> list[tuple[str, str]]:
    labels = (("policy_updates_per_hour", "policy updates per hour", "{:.0f}"),
              ("seconds_per_update", "seconds per update", "{:.2f}"),
              ("samples_per_update", "samples per update", "{:.0f}"),
              ("generated_tokens_per_update", "generated tokens per update", "{:.0f}"),
              ("devices", "devices held", "{:.0f}"),
              ("device_seconds_per_update", "device-seconds per update", "{:.1f}"))
    return [(label, form.format(capacity[key])) for key, label, form in labels if key in capacity]


def _validation_rows(validation: dict[str, dict[str, float]]) -> str:
    if not validation:
        return "<p>No validation in this run (trainer.val_every=0).</p>"
    head = "<tr><th>metric</th><th>first</th><th>last</th><th>best</th></tr>"
    body = "".join(
        f"<tr><td>{html.escape(key.removeprefix('val-core/'))}</td>"
        f"<td>{curve['first']:.3f} (step {curve['first_step']:.0f})</td>"
        f"<td>{curve['last']:.3f} (step {curve['last_step']:.0f})</td><td>{curve['best']:.3f}</td></tr>"
        for key, curve in validation.items())
    return f'<table id="validation"><thead>{head}</thead><tbody>{body}</tbody></table>'


def _advisor_section(verdict: dict[str, Any] | None) -> str:
    if verdict is None:
        return "<p>No placement plan recorded (trainer.plan unset): nothing to compare the ledger with.</p>"
    rows = [("verdict", "remap" if verdict["remap"] else "keep"), ("reason", str(verdict["reason"])),
            ("remaining iterations weighed", str(verdict["remaining_iterations"])),
            ("current plan", str(verdict["current_plan"]))]
    rows += [(f"drift of {node} (observed / predicted)", f"{ratio:.2f}") for node, ratio in verdict["drift"].items()]
    if verdict.get("new_plan"):
        rows += [("proposed plan", str(verdict["new_plan"])),
                 ("gain per iteration", f"{verdict['gain_per_iteration']:.3f} s"),
                 ("transition cost", f"{verdict['transition'].get('total_seconds', 0.0):.1f} s")]
    return _numbers_table(rows, "advisor")


def _sample_table(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return "<p>No samples: the run wrote no rollouts.jsonl (trainer.log_rollouts=0).</p>"
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in SAMPLE_COLUMNS)
    text_columns = {"prompt", "response", "ground_truth"}
    body = "".join(
        "<tr>" + "".join(f'<td{" class=text" if key in text_columns else ""} data-key="{key}">'
                         f"{_cell(sample.get(key))}</td>" for key, _ in SAMPLE_COLUMNS) + "</tr>"
        for sample in samples)
    return f'<table id="samples"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def render_html(run_dir: str | Path, summary: dict[str, Any], plots: list[Path], *, samples: int = 200) -> Path:
    """Write ``RUN_DIR/report.html`` (the ``samples`` most recent rollout samples, newest last); return its path."""
    run_dir = Path(run_dir)
    rows = read_rollouts(run_dir)[-samples:] if samples > 0 else []
    title = f"hybridflow run {run_dir.name}"
    parts = [
        f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<h2>Summary</h2>", _numbers_table(_summary_rows(summary), "summary"),
        "<h2>Capacity</h2>", _numbers_table(_capacity_rows(summary.get("capacity", {})), "capacity"),
        "<h2>Validation</h2>", _validation_rows(summary["validation"]),
        "<h2>Placement advisor</h2>", _advisor_section(summary.get("advisor")),
        "<h2>Plots</h2>", *(_image(path) for path in plots),
        f"<h2>Samples ({len(rows)} most recent)</h2>", _sample_table(rows),
        "</body></html>",
    ]
    path = run_dir / REPORT_FILE
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
