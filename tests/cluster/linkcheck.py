"""What a cluster link really does: TCP round-trip time and throughput between two namespace hosts.

Used by the tests of `Cluster.shape` (the delay relay and the token bucket must give the figures they
promise) and handy by hand. The server side runs in the peer's namespace, the client in the sender's.
"""

from __future__ import annotations

import subprocess
import sys
import time

from cluster.netns import Cluster, Host

PORT = 5998

_SERVER = """
import socket, sys
mode = sys.argv[1]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[2]))); s.listen(); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
received = 0
while True:
    data = c.recv(1 << 20)
    if not data:
        break
    received += len(data)
    if mode == "echo":
        c.sendall(data)
print(received, flush=True)
"""

_PING = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); s.send(b"x"); s.recv(16); times.append(time.perf_counter() - t)
times.sort(); print(times[len(times) // 2])
"""

_SEND = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = b"x" * (1 << 20)
t = time.perf_counter()
for _ in range(int(sys.argv[3])):
    s.sendall(block)
s.shutdown(socket.SHUT_WR); s.recv(1)  # returns when the peer has read everything and closed
print(time.perf_counter() - t)
"""


def _serve(cluster: Cluster, host: Host, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", host.netns, sys.executable, "-c", _SERVER, mode, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    if proc.stdout.readline().strip() != "listening":
        proc.kill()
        raise RuntimeError(f"link check server in {host.netns} did not start")
    return proc


def round_trip_s(cluster: Cluster, src: Host, dst: Host, count: int = 30) -> float:
    """Median round trip of a 1-byte TCP message from src to dst and back."""
    server = _serve(cluster, dst, "echo")
    try:
        return float(
            cluster.exec(src, [sys.executable, "-c", _PING, dst.address, str(PORT), str(count)]).stdout
        )
    finally:
        server.kill()
        server.wait()


def throughput_bit_s(cluster: Cluster, src: Host, dst: Host, mebibytes: int) -> float:
    """Bits per second of one TCP stream from src to dst, counted until the receiver has everything."""
    server = _serve(cluster, dst, "sink")
    try:
        started = time.perf_counter()
        seconds = float(
            cluster.exec(src, [sys.executable, "-c", _SEND, dst.address, str(PORT), str(mebibytes)]).stdout
        )
        received = int(server.communicate(timeout=60)[0].split()[-1])
        assert received == mebibytes << 20, f"sent {mebibytes} MiB, the peer read {received} bytes"
        return received * 8 / min(seconds, time.perf_counter() - started)
    finally:
        server.kill()
        server.wait()
