"""The capacity unit: policy updates per hour and, per update, samples, generated tokens and device-seconds."""

from __future__ import annotations

from hybridflow.trainer.capacity import compute_capacity, format_capacity

CONFIG = {"data": {"batch_size": 8}, "rollout": {"n": 4},
          "resource_pools": {"train": {"devices_per_node": [2, 2]}, "reward": {"devices_per_node": [1]}}}


def test_capacity_from_metrics_and_config() -> None:
    metrics = [{"time/step_s": 2.0, "response/length_mean": 5.0}, {"time/step_s": 4.0, "response/length_mean": 7.0}]
    capacity = compute_capacity(metrics, CONFIG)
    assert capacity == {"policy_updates_per_hour": 1200.0, "seconds_per_update": 3.0, "samples_per_update": 32.0,
                        "generated_tokens_per_update": 192.0, "devices": 5.0, "device_seconds_per_update": 15.0}
    assert format_capacity(capacity) == ("capacity: 1200 policy updates/hour; per update 32 samples, 192 generated "
                                         "tokens, 15.0 device-seconds (5 devices)")


def test_capacity_without_a_config_keeps_what_it_can() -> None:
    assert compute_capacity([{"time/step_s": 1.0}], {}) == {"policy_updates_per_hour": 3600.0,
                                                            "seconds_per_update": 1.0}
    assert compute_capacity([], CONFIG) == {}
    assert format_capacity({}) == "capacity: no timed steps"
