"""A one-way delay for a namespace host's outgoing traffic, without netem: a TUN device and this relay.

This kernel has no netem qdisc (nor fq, whose departure times a BPF program could set), so a link's
propagation delay is made in user space. Inside one host's namespace (see `netns.Cluster.shape`):

    socket -> route to the cluster subnet via the TUN device (policy rule for locally sent packets)
           -> the TUN's own qdisc (tbf: the link rate, with back-pressure to TCP as on a real NIC)
           -> this relay: each packet held until its arrival time + delay, in order
           -> written back into the TUN, received as if from a wire, forwarded out of eth0.

Rate first, then delay: serialisation, then propagation, as on a real link. Each host delays what it
sends, so a round trip between two hosts takes twice the delay, as with netem on both ends. The MTU of
the path is raised (netns.py) so that a packet is up to 64 KiB and the relay moves a few thousand packets
per second at 1 Gbit/s, which Python does with a few percent of a core. It asks for a real-time priority
so that busy training ranks on the same cores don't add their scheduling delays to the link's.

Run by netns.py as `ip netns exec NS python delayline.py DEV DELAY_MS`; prints `ready` once the device
exists, and ends with its device (the kernel removes a TUN, and the routes through it, when its last file
descriptor closes) when killed.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_BYTES = 65536 + 64
"""Above the largest MTU netns.py sets (65000), so no packet is ever cut short."""


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(fd: int, delay_ns: int) -> None:
    """Hold every packet read from the device for delay_ns, then write it back; never returns."""
    held: collections.deque[tuple[int, bytes]] = collections.deque()
    while True:
        now = time.monotonic_ns()
        while held and held[0][0] <= now:
            due, packet = held.popleft()
            with contextlib.suppress(BlockingIOError):  # device queue full: dropped, as a wire would
                os.write(fd, packet)
        timeout = None if not held else (held[0][0] - now) / 1e9
        ready, _, _ = select.select([fd], [], [], timeout)
        if ready:
            while True:
                try:
                    packet = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                held.append((time.monotonic_ns() + delay_ns, packet))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: delayline.py DEVICE DELAY_MS", file=sys.stderr)
        return 2
    name, delay_ms = argv[0], float(argv[1])
    with contextlib.suppress(OSError):  # not permitted: still correct, only more jitter under load
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    fd = open_tun(name)
    print("ready", flush=True)
    relay(fd, int(delay_ms * 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
