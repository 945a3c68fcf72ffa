"""The narrow channel between the judge and its worker: framed JSON messages over a socket.

A message is a fixed 8-byte frame (header length, payload length), a JSON header and raw
payload bytes (token ids going to the worker). Nothing is ever unpickled: what the worker
sends is data the judge parses under hard size limits, so a hostile worker can make a message
invalid, never make the judge run code. Logits do not travel here: the worker writes them into
a shared output buffer (`OutputBuffer`, an anonymous memfd the judge created and lent it), and
the judge copies what it needs out of it into its own memory before looking at it.
"""
from __future__ import annotations

import fcntl
import json
import mmap
import os
import select
import socket
import struct
import time

FRAME = struct.Struct("<II")         # header bytes, payload bytes
MAX_HEADER_BYTES = 1 << 20           # a worker's answer is small JSON; more is a broken worker
MAX_PAYLOAD_BYTES = 1 << 30          # token ids of one trace; the judge's own messages only


class ChannelClosed(Exception):
    """The other side went away, broke the framing, or did not answer in time."""


def send(sock: socket.socket, header: dict, payload: bytes = b"", fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(header).encode()
    frame = FRAME.pack(len(body), len(payload)) + body
    try:
        if fds:
            socket.send_fds(sock, [frame], list(fds))
            if payload:
                sock.sendall(payload)
        else:
            sock.sendall(frame + payload)   # one write: one wake-up on the other side
    except OSError as e:
        raise ChannelClosed(f"the channel closed while sending ({e})") from e


def _read_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelClosed("no answer in time")
            sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout as e:
            raise ChannelClosed("no answer in time") from e
        except OSError as e:
            raise ChannelClosed(f"the channel broke ({e})") from e
        if not chunk:
            raise ChannelClosed("the other side closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def spin_until_readable(sock: socket.socket, deadline: float | None, still_there=lambda: True) -> None:
    """Busy-wait (no sleep) until `sock` has data. A blocked process woken by the kernel on a
    GPU host with idle cores in deep sleep states answers 0.2-0.4 ms late (H100 host, measured
    by python3 -m scripts.gpu judge-split); the clock around a timed trace must not pay that."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    spins = 0
    while not poller.poll(0):
        spins += 1
        if spins % 4096 == 0:
            if deadline is not None and time.monotonic() > deadline:
                raise ChannelClosed("no answer in time")
            if not still_there():
                raise ChannelClosed("the other side is gone")


def receive(sock: socket.socket, deadline: float | None = None, max_payload: int = MAX_PAYLOAD_BYTES,
            want_fds: bool = False) -> tuple[dict, bytes, list[int]]:
    """(header, payload, received fds). Raises ChannelClosed on EOF, timeout or a malformed
    message (too large, not a JSON object)."""
    fds: list[int] = []
    if want_fds:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            first, fds, _, _ = socket.recv_fds(sock, FRAME.size, 4)
        except socket.timeout as e:
            raise ChannelClosed("no answer in time") from e
        except OSError as e:
            raise ChannelClosed(f"the channel broke ({e})") from e
        if not first:
            raise ChannelClosed("the other side closed the channel")
        frame = first + _read_exact(sock, FRAME.size - len(first), deadline)
    else:
        frame = _read_exact(sock, FRAME.size, deadline)
    header_len, payload_len = FRAME.unpack(frame)
    if header_len > MAX_HEADER_BYTES or payload_len > max_payload:
        raise ChannelClosed(f"a message of {header_len} + {payload_len} bytes is past the channel's limits")
    try:
        header = json.loads(_read_exact(sock, header_len, deadline))
    except (ValueError, RecursionError) as e:
        raise ChannelClosed(f"a message that is not JSON ({type(e).__name__})") from e
    if not isinstance(header, dict):
        raise ChannelClosed("a message that is not a JSON object")
    payload = _read_exact(sock, payload_len, deadline) if payload_len else b""
    return header, payload, fds


class OutputBuffer:
    """Logits the worker writes and the judge reads: an anonymous shared file of fp32 values.

    The judge creates it and hands the worker its descriptor (the only thing the worker can
    reach of the judge's memory); it grows by being replaced with a larger one."""

    def __init__(self, nbytes: int, fd: int | None = None):
        self.nbytes = nbytes
        if fd is None:
            fd = os.memfd_create("judge-outputs", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
            # Its size fixed for good: a worker that shrank it would crash the judge (SIGBUS) on read.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.fd = fd
        self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a tensor still views it: the mapping goes when that tensor does
            pass
        os.close(self.fd)
