"""DeepSpeed engines built in the pytest process itself (not in a worker process), after other modules ran there.

Importable as ``deepspeed_in_process`` because pytest puts ``tests/`` (the rootdir conftest's folder) on ``sys.path``.
"""

from __future__ import annotations


def release_stale_deepspeed_groups() -> None:
    """Drop DeepSpeed's references to process groups of an earlier torch.distributed world.

    This pytest process may have run another module's DeepSpeed engine in a world that a later module destroyed with
    torch's own ``destroy_process_group`` (the vLLM launcher tests do): DeepSpeed still holds groups of that world
    (its cloned world group), which the next engine would use ("Group ... is not registered"). Release its
    references (not the world), as ``deepspeed.comm.destroy_process_group`` does after a teardown; a worker process,
    which builds one engine in one world, never needs this."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)
