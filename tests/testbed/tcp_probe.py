"""A TCP probe run inside test-bed hosts: `serve PORT` answers each connection with the caller's address and
echoes one-byte pings; `call HOST PORT NUM_BYTES` prints JSON: the address the server saw, ping RTTs, and how
long NUM_BYTES took to arrive (the server acknowledges their end)."""

from __future__ import annotations

import json
import socket
import sys
import time

PINGS = 10


def read_exactly(conn: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        more = conn.recv(min(num_bytes - len(data), 1 << 20))
        if not more:
            raise ConnectionError("the peer closed the connection")
        data += more
    return data


def serve(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)
    print("ready", flush=True)
    while True:
        conn, (address, _) = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(address.encode().ljust(16))
        for _ in range(PINGS):
            conn.sendall(conn.recv(1))
        size = int(read_exactly(conn, 16).decode())
        while size > 0:
            size -= len(read_exactly(conn, min(size, 1 << 20)))
        conn.sendall(b"k")
        conn.close()


def call(host: str, port: int, num_bytes: int) -> None:
    try:
        conn = socket.create_connection((host, port), timeout=10)
    except OSError as exc:
        print(json.dumps({"error": str(exc)}))
        return
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    seen = read_exactly(conn, 16).decode().strip()
    rtts = []
    for _ in range(PINGS):
        start = time.perf_counter()
        conn.sendall(b"p")
        conn.recv(1)
        rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    conn.sendall(str(num_bytes).encode().ljust(16) + bytes(num_bytes))
    conn.recv(1)
    print(json.dumps({"seen_as": seen, "rtts_s": rtts, "transfer_s": time.perf_counter() - start}))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        call(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
