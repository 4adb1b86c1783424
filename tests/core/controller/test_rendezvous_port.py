"""Rank 0's rendezvous port stays reserved from the moment the driver learns it: no other process can bind it or be
handed it by the kernel, on any local address, while torch's TCPStore (what ``init_process_group`` starts on rank
0) still binds it.

"Any local address" is the point: TCPStore listens on every address, so a port held on the node's IP alone was still
handed to a reservation on 127.0.0.1, whose store then took the wildcard listen, and rank 0's store failed with
EADDRINUSE (a multi-node run whose rendezvous is the node IP beside a local run on 127.0.0.1, under pytest-xdist)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from hybridflow.controller.host import reserve_port

# every 127.x.y.z is a local address on Linux: two distinct ones stand for "the node IP" and "loopback"
ADDRESSES = ("127.0.0.1", "127.0.0.2")


def test_a_reserved_port_is_kept_from_others_on_every_address_and_open_to_the_store() -> None:
    reservation = reserve_port()
    port = reservation.getsockname()[1]
    try:
        for address in (*ADDRESSES, ""):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
                other.bind((address, port))
        for address in ADDRESSES:  # the kernel's free-port choice, as another reservation makes it
            handed_out = set()
            for _ in range(300):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind((address, 0))
                    handed_out.add(probe.getsockname()[1])
            assert port not in handed_out, address
        store = dist.TCPStore(ADDRESSES[1], port, 1, True, timeout=datetime.timedelta(seconds=10))
        client = dist.TCPStore(ADDRESSES[0], port, 1, False, timeout=datetime.timedelta(seconds=10))
        client.set("rank1", "up")
        assert store.get("rank1") == b"up"
        del client, store
    finally:
        reservation.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as after:  # released with the socket
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))


def test_a_port_held_on_loopback_only_is_not_handed_to_a_wildcard_reservation() -> None:
    """The spawn test helper holds rank 0's port on 127.0.0.1 while worker groups reserve on every address."""
    held = reserve_port("127.0.0.1")
    port = held.getsockname()[1]
    try:
        others = [reserve_port() for _ in range(200)]
        assert port not in {sock.getsockname()[1] for sock in others}
        for sock in others:
            sock.close()
    finally:
        held.close()
