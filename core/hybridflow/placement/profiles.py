"""Device and interconnect profiles (peak FLOP/s, memory, bandwidths) as plain data, plus efficiency factors.

Numbers are vendor peaks; how much of a peak a stage reaches is the simulator's :class:`Efficiency`, which
calibration fits from ledgers. This module does not know about models, workloads or parallel layouts.
Stability: developer.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from hybridflow.errors import ConfigError

__all__ = [
    "DeviceProfile",
    "InterconnectProfile",
    "Efficiency",
    "Cluster",
    "DEVICE_PROFILES",
    "INTERCONNECT_PROFILES",
    "get_device_profile",
    "build_cluster",
]

GB = 1e9
GiB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class InterconnectProfile:
    """Bandwidth (bytes/s, per device, one direction) and latency (s) of one link class."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ConfigError(f"Interconnect {self.name!r}: expected bandwidth > 0 and latency >= 0, "
                              f"got {self.bandwidth} and {self.latency}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """One accelerator: dense bf16 peak, memory capacity and bandwidth, and its usual links."""

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    intra_node: InterconnectProfile
    inter_node: InterconnectProfile
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.memory_bytes, self.memory_bandwidth) <= 0:
            raise ConfigError(f"Device profile {self.name!r}: peak_flops, memory_bytes and memory_bandwidth "
                              "must all be > 0.")


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """Fractions of peak each kind of work reaches; the knobs calibration fits from measured ledgers.

    ``saturation_tokens`` models small local batches: compute efficiency is scaled by x / (x + saturation_tokens)
    where x is the tokens one device processes in a stage, so a fixed global batch spread thin loses efficiency.
    ``sync_latency_seconds`` is the cost of one ring hop of a collective over fully sharded (FSDP/ZeRO-3)
    data-parallel weights, which gather per layer and micro batch: 0 (the default) leaves such engines to the
    bandwidth terms; on oversubscribed CPU workers it is milliseconds and dominates small models (calibration
    fits it from runs with different data-parallel sizes).
    ``controller_seconds``: the single controller's own time on each iteration's critical path, outside every node
    (dispatching calls, gathering their results, computing rewards and advantages on the driver, the ledger); added
    once per iteration (:attr:`Plan.iteration_seconds`). 0 by default; calibration measures it from ledgers.
    ``collective_stall``: on devices that share cores (:attr:`Cluster.compute_units`), a stage on more than one rank
    synchronises them at every collective, so a rank the OS preempts stalls its group; such a stage progresses at its
    processor share / (1 + collective_stall). 0 by default (no effect on devices with compute of their own).
    """

    train: float = 0.45
    infer: float = 0.55
    prefill: float = 0.55
    decode_bandwidth: float = 0.6
    comm: float = 0.7
    saturation_tokens: float = 2048.0
    usable_memory_fraction: float = 0.9
    transition_overhead_seconds: float = 0.5
    sync_latency_seconds: float = 0.0
    controller_seconds: float = 0.0
    collective_stall: float = 0.0

    def __post_init__(self) -> None:
        for name in ("train", "infer", "prefill", "decode_bandwidth", "comm", "usable_memory_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"Efficiency.{name} must be in (0, 1], got {value}.")
        for name in ("saturation_tokens", "transition_overhead_seconds", "sync_latency_seconds",
                     "controller_seconds", "collective_stall"):
            if getattr(self, name) < 0:
                raise ConfigError(f"Efficiency.{name} must be >= 0, got {getattr(self, name)}.")

    def scaled(self, **factors: float) -> Efficiency:
        """Return a copy with the named fractions multiplied by ``factors`` and clipped to (0, 1]."""
        values = {name: min(1.0, max(1e-4, getattr(self, name) * factor)) for name, factor in factors.items()}
        return replace(self, **values)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """``num_devices`` devices of one profile, ``devices_per_node`` per node.

    ``compute_units``: how many devices' worth of compute the cluster really has when its devices are slots that
    share it (CPU worker slots on a box with fewer cores than slots). None (GPUs): every device computes on its
    own. When set, stages running at the same time on more devices than this share it (processor sharing), so
    overlapping disjoint sets buys nothing once the cores are busy.
    """

    device: DeviceProfile
    num_devices: int
    devices_per_node: int
    compute_units: float | None = None

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.devices_per_node < 1:
            raise ConfigError(f"Cluster needs >= 1 device and >= 1 device per node, got {self.num_devices} "
                              f"devices and {self.devices_per_node} per node.")
        if self.compute_units is not None and self.compute_units <= 0:
            raise ConfigError(f"Cluster.compute_units must be > 0 (or None: every device has its own compute), "
                              f"got {self.compute_units}.")

    def link(self, group_size: int, stride: int = 1) -> InterconnectProfile:
        """The slowest link a communication group of ``group_size`` ranks at ``stride`` crosses."""
        return self.device.intra_node if group_size * stride <= self.devices_per_node else self.device.inter_node


_NVLINK3 = InterconnectProfile(name="nvlink3", bandwidth=300 * GB, latency=5e-6)
_NVLINK4 = InterconnectProfile(name="nvlink4", bandwidth=450 * GB, latency=4e-6)
_IB_100 = InterconnectProfile(name="ib-800gbps-per-node", bandwidth=12.5 * GB, latency=10e-6)
# HybridFlow's testbed (EuroSys '25, §8.1): "The inter-machine bandwidth is 200Gbps", shared by a machine's 8 GPUs
_IB_25 = InterconnectProfile(name="ib-200gbps-per-node", bandwidth=25 * GB / 8, latency=10e-6)
_IB_400 = InterconnectProfile(name="ib-400gbps-per-gpu", bandwidth=50 * GB, latency=8e-6)
_LOOPBACK = InterconnectProfile(name="shared-memory", bandwidth=5 * GB, latency=50e-6)
_ETHERNET = InterconnectProfile(name="ethernet-10g", bandwidth=1.25 * GB, latency=100e-6)

INTERCONNECT_PROFILES: dict[str, InterconnectProfile] = {
    p.name: p for p in (_NVLINK3, _NVLINK4, _IB_100, _IB_25, _IB_400, _LOOPBACK, _ETHERNET)
}

DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "a100-80gb": DeviceProfile(name="a100-80gb", peak_flops=312e12, memory_bytes=80 * GB,
                               memory_bandwidth=2.0e12, intra_node=_NVLINK3, inter_node=_IB_100),
    "a100-80gb-hybridflow": DeviceProfile(name="a100-80gb-hybridflow", peak_flops=312e12, memory_bytes=80 * GB,
                                          memory_bandwidth=2.0e12, intra_node=_NVLINK3, inter_node=_IB_25),
    "a100-40gb": DeviceProfile(name="a100-40gb", peak_flops=312e12, memory_bytes=40 * GB,
                               memory_bandwidth=1.55e12, intra_node=_NVLINK3, inter_node=_IB_100),
    "h100-80gb": DeviceProfile(name="h100-80gb", peak_flops=989e12, memory_bytes=80 * GB,
                               memory_bandwidth=3.35e12, intra_node=_NVLINK4, inter_node=_IB_400),
    "h200-141gb": DeviceProfile(name="h200-141gb", peak_flops=989e12, memory_bytes=141 * GB,
                                memory_bandwidth=4.8e12, intra_node=_NVLINK4, inter_node=_IB_400),
    "cpu": DeviceProfile(name="cpu", peak_flops=0.2e12, memory_bytes=16 * GB, memory_bandwidth=20e9,
                         intra_node=_LOOPBACK, inter_node=_ETHERNET, device_type="cpu"),
}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb"}


def get_device_profile(name: str) -> DeviceProfile:
    """Look up a profile by name or alias (``a100``, ``h100``, ``h200``, ``cpu``); unknown names list the known."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key in DEVICE_PROFILES:
        return DEVICE_PROFILES[key]
    known = sorted([*DEVICE_PROFILES, *_ALIASES])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f' Did you mean "{close[0]}"?' if close else ""
    raise ConfigError(f'Unknown device profile "{name}". Known: {", ".join(known)}.{hint}')


def build_cluster(profile: str | DeviceProfile, num_devices: int, devices_per_node: int = 8,
                  memory_gb: float | None = None, compute_units: float | None = None) -> Cluster:
    """Build a :class:`Cluster`, optionally overriding the per-device memory (decimal GB); ``compute_units`` when
    the devices share fewer cores than they are (see :class:`Cluster`)."""
    device = get_device_profile(profile) if isinstance(profile, str) else profile
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ConfigError(f"Device memory must be > 0 GB, got {memory_gb}.")
        device = replace(device, memory_bytes=memory_gb * GB)
    return Cluster(device=device, num_devices=num_devices, devices_per_node=min(devices_per_node, num_devices),
                   compute_units=compute_units)
