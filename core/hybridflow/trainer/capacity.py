"""What a finished run is worth and whether its placement still fits: the capacity unit (completed policy updates per
hour and, per update, the samples, generated tokens and device-seconds consumed) from its metrics and config, and the
placement advisor's verdict on its own ledger.

It computes; ``hybridflow train`` prints both at the end and ``hybridflow report`` shows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["compute_capacity", "format_capacity", "advise_placement", "format_verdict", "read_run_config"]


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The config the run recorded in manifest.json (empty when the run has no manifest)."""
    path = run_dir / "manifest.json"
    if not path.exists():
        return {}
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")).get("config", {})
    return config


def compute_capacity(metrics: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, float]:
    """The capacity unit of a run: completed policy updates per hour and, per update, the samples (prompts × n),
    generated (response) tokens and device-seconds (the devices of every resource pool held for the step's wall
    time). Missing facts (an old run without a manifest) leave their entries out."""
    seconds = [float(m["time/step_s"]) for m in metrics if "time/step_s" in m]
    out: dict[str, float] = {}
    if not seconds:
        return out
    per_update = sum(seconds) / len(seconds)
    out["policy_updates_per_hour"] = 3600.0 / per_update if per_update else 0.0
    out["seconds_per_update"] = per_update
    samples = None
    data, rollout = config.get("data", {}), config.get("rollout", {})
    if "batch_size" in data and "n" in rollout:
        samples = float(data["batch_size"]) * float(rollout["n"])
        out["samples_per_update"] = samples
    lengths = [float(m["response/length_mean"]) for m in metrics if "response/length_mean" in m]
    if samples is not None and lengths:
        out["generated_tokens_per_update"] = samples * sum(lengths) / len(lengths)
    pools = config.get("resource_pools", {})
    devices = sum(sum(pool.get("devices_per_node", [])) for pool in pools.values())
    if devices:
        out["devices"] = float(devices)
        out["device_seconds_per_update"] = devices * per_update
    return out


def format_capacity(capacity: dict[str, float]) -> str:
    """One line: ``capacity: 3440 policy updates/hour; per update 64 samples, 478 generated tokens, ...``."""
    if "policy_updates_per_hour" not in capacity:
        return "capacity: no timed steps"
    parts = [f"{capacity['samples_per_update']:.0f} samples" if "samples_per_update" in capacity else "",
             f"{capacity['generated_tokens_per_update']:.0f} generated tokens"
             if "generated_tokens_per_update" in capacity else "",
             f"{capacity['device_seconds_per_update']:.1f} device-seconds ({capacity['devices']:.0f} devices)"
             if "device_seconds_per_update" in capacity else ""]
    per_update = ", ".join(part for part in parts if part)
    return (f"capacity: {capacity['policy_updates_per_hour']:.0f} policy updates/hour"
            + (f"; per update {per_update}" if per_update else ""))


def advise_placement(run_dir: Path, remaining: int | None = None) -> dict[str, Any] | None:
    """The remap advisor's verdict on the run's own ledger (``hybridflow plan --from-run``), when the run recorded a
    plan (``trainer.plan``); None otherwise. ``remaining`` defaults to the run's ``trainer.total_steps``: the verdict
    for running as long again. Nothing is written to advisor.jsonl."""
    from hybridflow.placement.record import PLAN_FILE

    if not (run_dir / PLAN_FILE).exists():
        return None
    from hybridflow.placement.advisor import advise_remap

    if remaining is None:
        remaining = int(read_run_config(run_dir).get("trainer", {}).get("total_steps", 0))
    verdict: dict[str, Any] = advise_remap(run_dir, remaining, write=False).to_json()
    return verdict


def format_verdict(verdict: dict[str, Any]) -> str:
    """``placement advisor: KEEP: ...`` (or REMAP) with the drifting nodes."""
    drift = ", ".join(f"{node} ×{ratio:.2f}" for node, ratio in verdict.get("drift", {}).items())
    return (f"placement advisor ({verdict['remaining_iterations']} iterations): "
            f"{'REMAP' if verdict['remap'] else 'KEEP'}: {verdict['reason']}" + (f" Drift: {drift}." if drift else ""))
