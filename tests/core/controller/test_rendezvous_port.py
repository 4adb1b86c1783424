"""Rank 0's rendezvous port stays reserved from the moment the driver learns it: no other process can bind it or be
handed it by the kernel, while torch's TCPStore (what ``init_process_group`` starts on rank 0) still binds it."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from hybridflow.controller.host import reserve_port


def test_a_reserved_port_is_kept_from_others_and_open_to_the_store() -> None:
    reservation = reserve_port("127.0.0.1")
    port = reservation.getsockname()[1]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        handed_out = set()
        for _ in range(300):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("127.0.0.1", 0))
                handed_out.add(probe.getsockname()[1])
        assert port not in handed_out
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("rank0", "up")
        assert store.get("rank0") == b"up"
        del store
    finally:
        reservation.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as after:  # released with the socket
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))
