"""The local Ray a test module runs on, shared by the modules of one pytest worker.

Starting Ray costs seconds (tens under load): a module reuses the Ray an earlier module left up when it has the
logical CPUs this module wants and all of them are free (nothing leaked: no placement group or actor of the earlier
module still holds a CPU; the worker processes a finished run parked for the next one, hybridflow.controller.park,
count as free: a pool of another shape releases them); otherwise it shuts that Ray down and starts its own.
Importable as ``local_ray`` because pytest puts ``tests/`` (the rootdir conftest's folder) on ``sys.path``.
"""

from __future__ import annotations

import time


def ensure_local_ray(num_cpus: int, object_store_memory: int) -> None:
    """A local Ray with ``num_cpus`` logical CPUs, all free: the running one when it fits, else a fresh one."""
    import ray

    from hybridflow.controller import init_ray, shutdown_ray
    from hybridflow.controller.park import parked_resources

    if ray.is_initialized():
        deadline = time.monotonic() + 5.0  # resources freed by the last module's kills are reported with a lag
        while ray.cluster_resources().get("CPU") == num_cpus:  # type: ignore[no-untyped-call]
            free = ray.available_resources().get("CPU", 0.0) + parked_resources().get("CPU", 0.0)  # type: ignore[no-untyped-call]
            if abs(free - num_cpus) < 1e-6:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        shutdown_ray()
    init_ray(num_cpus=num_cpus, object_store_memory=object_store_memory)
