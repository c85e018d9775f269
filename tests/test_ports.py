"""Rendezvous ports for tests and examples come from below the kernel's ephemeral range, free to listen on."""

from __future__ import annotations

import socket

from ml_flashpoint_nemo.testing import ports


def test_the_port_is_below_the_ephemeral_range_and_free():
    low, _ = ports._ephemeral_range()
    port = ports.free_port()
    assert port < low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if something listens there


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
