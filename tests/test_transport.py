"""The blocking transport's short poll before a read (``ReadySpinner``)."""

from __future__ import annotations

import socket
import time

import trio
import trio.testing

from cumulus_p2p.channel.transport import (
    CountingChannel,
    ReadySpinner,
    SocketFrameChannel,
    TrioFrameChannel,
)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected TCP sockets on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def test_spinner_returns_at_once_when_data_is_waiting() -> None:
    a, b = tcp_pair()
    with a, b:
        b.sendall(b"x")
        spinner = ReadySpinner(a, spin_s=5.0)
        t0 = time.perf_counter()
        spinner.spin()
        assert time.perf_counter() - t0 < 1.0


def test_spinner_gives_up_after_its_window_when_nothing_arrives() -> None:
    a, b = tcp_pair()
    with a, b:
        spinner = ReadySpinner(a, spin_s=0.02)
        t0 = time.perf_counter()
        spinner.spin()
        elapsed = time.perf_counter() - t0
        assert 0.02 <= elapsed < 1.0


def test_a_channel_with_spinning_off_still_reads_whole_frames() -> None:
    a, b = tcp_pair()
    reader = SocketFrameChannel(a, spin_s=0.0)
    writer = SocketFrameChannel(b)
    try:
        writer.send_frame([b"hello ", b"world"])
        assert reader.recv_frame() == bytearray(b"hello world")
    finally:
        reader.close()
        writer.close()


async def test_a_counting_channel_reports_each_frame_both_ways() -> None:
    left, right = trio.testing.memory_stream_pair()
    counted: list[int] = []
    near = CountingChannel(TrioFrameChannel(left), counted.append)
    far = TrioFrameChannel(right)
    await near.send_frame([b"abc", b"de"])
    assert await far.receive_frame() == bytearray(b"abcde")
    await far.send_frame([b"xyz"])
    assert await near.receive_frame() == bytearray(b"xyz")
    assert counted == [4 + 5, 4 + 3]
