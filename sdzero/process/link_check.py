"""Can this host still reach the rendezvous? The stall watch's test for a link taken down.

A rank whose host lost its link waits in a collective like every other rank; its watcher thread beats on,
and its host file still reaches the shared output folder, so neither says which host is cut off. The
rendezvous (MASTER_ADDR:MASTER_PORT, torch's TCP store, served by rank 0 for the whole run) is one address
every host reaches while its link is up: a TCP connect to it, from each rank's watcher thread (never from
the loop), only once the rank has sat in one loop phase for CHECK_AFTER_S, and at most every CHECK_EVERY_S.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

CHECK_AFTER_S = 3.0
"""A host whose ranks all sat in one phase this long checks its link: a step of a healthy run is shorter,
so a running job makes no connections at all."""
CHECK_EVERY_S = 2.0
CONNECT_TIMEOUT_S = 1.0


def rendezvous(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        return None
    return addr, int(port)


def reaches(address: tuple[str, int], timeout: float = CONNECT_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:  # refused, unreachable, timed out: no way to the rendezvous
        return False


class LinkCheck:
    """The host's last answer (None: not checked, or no rendezvous known), refreshed while it is idle."""

    def __init__(self, address: tuple[str, int] | None) -> None:
        self.address = address
        self.answer: bool | None = None
        self._checked = float("-inf")

    def update(self, idle_s: float, now: float | None = None) -> bool | None:
        """`idle_s`: how long the rank has been in its current phase."""
        now = time.monotonic() if now is None else now
        if self.address is None or idle_s < CHECK_AFTER_S:
            self.answer = None
            return None
        if now - self._checked >= CHECK_EVERY_S:
            self._checked = now
            self.answer = reaches(self.address)
        return self.answer
