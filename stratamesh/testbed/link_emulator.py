"""A WAN cable in user space, for kernels without tc netem: two TAP devices and the delay, rate and loss between them.

    python -m stratamesh.testbed.link_emulator      # reads commands from stdin, one JSON object a line

A cable joins a TAP device in one network namespace to a TAP device in another. Every Ethernet frame read
from one end is written to the other after its serialization time at the cable's rate (frames queue behind
each other, as on a real uplink), plus half the round-trip delay; a frame is dropped with the loss
probability, or when the queue already holds more than LINK_QUEUE_S of the rate's bytes (a router's tail drop).

Commands: {"op": "cable", "name": ..., "a": [ns, dev], "b": [ns, dev], "rate_mbit": .., "rtt_ms": .., "loss_pct": ..}
and {"op": "shape", "name": ..., ...the same three numbers}. Each is answered with one line, "ok" or
"error: why". The process ends when stdin closes, and the kernel deletes the TAPs' traffic with it.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import struct
import sys
import threading
import time
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME_BYTES = 65536 + 64
LINK_QUEUE_S = 0.25         # a queue deeper than this much of the rate drops what arrives (an unshaped rate: none)
MIN_QUEUE_BYTES = 1 << 20


@dataclass(slots=True)
class Shape:
    """One direction of a cable: rate in bits/s (0: unlimited), one-way delay, loss probability."""

    rate_bps: float
    delay_s: float
    loss: float

    @classmethod
    def of(cls, command: dict) -> Shape:
        return cls(float(command.get("rate_mbit", 0)) * 1e6, float(command.get("rtt_ms", 0)) / 2000.0,
                   float(command.get("loss_pct", 0)) / 100.0)


def open_tap(namespace: str, device: str) -> int:
    """An fd of the TAP device named device in namespace (opened from inside it, then back home)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TAP | IFF_NO_PI))
        return fd
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        os.close(target)


class Direction:
    """Frames from one TAP to the other: a reader thread queues each with its delivery time, a writer sends it then."""

    def __init__(self, src: int, dst: int, shape: Shape):
        self.src, self.dst, self.shape = src, dst, shape
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._line_free_at = 0.0            # when the last queued frame has been serialized onto the line
        self._ready = threading.Condition()
        self._rng = random.Random()

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                frame = os.read(self.src, MAX_FRAME_BYTES)
            except OSError:
                return      # the device is gone: the test bed is being torn down
            shape = self.shape
            if shape.loss and self._rng.random() < shape.loss:
                continue
            now = time.monotonic()
            with self._ready:
                if shape.rate_bps:
                    if self._queued_bytes > max(MIN_QUEUE_BYTES, shape.rate_bps / 8 * LINK_QUEUE_S):
                        continue
                    self._line_free_at = max(now, self._line_free_at) + len(frame) * 8 / shape.rate_bps
                    at = self._line_free_at + shape.delay_s
                else:
                    at = now + shape.delay_s
                self._queue.append((at, frame))
                self._queued_bytes += len(frame)
                self._ready.notify()

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                at, frame = self._queue[0]
            wait_s = at - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
            with self._ready:
                self._queue.popleft()
                self._queued_bytes -= len(frame)
            try:
                os.write(self.dst, frame)
            except OSError:
                pass        # the far end is down (not up yet, or deleted): the frame is lost, as on a cable


def serve(lines: object, out: object) -> None:
    """Applies each command line; one answer line per command."""
    cables: dict[str, tuple[Direction, Direction]] = {}
    for line in lines:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            shape = Shape.of(command)       # both directions alike; a re-shape replaces it, never changes it
            if command["op"] == "cable":
                a, b = open_tap(*command["a"]), open_tap(*command["b"])
                cables[command["name"]] = (Direction(a, b, shape), Direction(b, a, shape))
                for direction in cables[command["name"]]:
                    direction.start()
            elif command["op"] == "shape":
                for direction in cables[command["name"]]:
                    direction.shape = shape
            else:
                raise ValueError(f"unknown op {command['op']!r}")
            print("ok", file=out, flush=True)
        except Exception as exc:  # an answer, not a crash: the test bed says what failed
            print(f"error: {type(exc).__name__}: {exc}", file=out, flush=True)


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
