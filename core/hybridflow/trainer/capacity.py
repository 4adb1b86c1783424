"""The capacity unit runs are compared in, from a run's per-step metrics and its config: completed policy updates per
hour and, per update, the samples, generated tokens and device-seconds consumed.

It computes; ``hybridflow train`` prints it at the end and ``hybridflow report`` shows it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compute_capacity", "format_capacity"]


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
