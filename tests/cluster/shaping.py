"""The namespace cluster's links: a token-bucket rate (`tc tbf`) and a one-way delay on every host's link.

This kernel has no `netem` ("Specified qdisc kind is unknown"), so the delay is a TUN device in each host
and a relay process that holds each packet for the delay (delayline.py says how); the rate limit then sits
on that device, before the delay. The relays stay outside the hosts' CPU quotas: they stand for the NIC,
not for the host's cores.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.system import cmdline, run

if TYPE_CHECKING:
    from cluster.netns import Cluster

DELAY_DEVICE = "sdzdelay"
DELAY_TABLE = "177"
"""Routing table (and rule priority) that sends a host's own packets to the cluster through DELAY_DEVICE."""
DELAYED_MTU = 65000
"""MTU of every link while a delay is on: big packets keep the user-space relay to a few thousand a second."""
PLAIN_MTU = 1500


def shape(cluster: Cluster, rate: str | None, delay_ms: float | None = None) -> None:
    """Rate-limit every host's outgoing link with a token bucket and/or delay it by delay_ms one way
    (a round trip between two hosts then takes 2 x delay_ms); None removes either."""
    if delay_ms is not None and not 0 < delay_ms <= 1000:
        raise ValueError(f"delay_ms={delay_ms}: must be in (0, 1000] ms")
    if delay_ms != cluster.delay_ms:
        delay_off(cluster)
        if delay_ms:
            delay_on(cluster, delay_ms)
    device = DELAY_DEVICE if delay_ms else "eth0"
    for h in cluster.members:
        cluster.exec(h, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        if rate is not None:
            # The bucket must hold one whole packet at the largest MTU (65000 with a delay); tbf's
            # hrtimer watchdog keeps the rate with no more (measured 199/976 Mbit/s at 200M/1G).
            # Anything above lets that much through at memory speed after each idle moment, which no
            # real link does: 256 kB was 10 ms of free traffic at 200 Mbit/s, after every compute
            # phase, and made the link look faster to a trial than to the back-to-back benchmark.
            cluster.exec(
                h,
                [
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    device,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "70kb",
                    "latency",
                    "50ms",
                ],
            )
        elif delay_ms:
            cluster.exec(h, ["tc", "qdisc", "del", "dev", device, "root"], check=False)
    cluster.shaped_rate = rate
    cluster._save()


def delay_on(cluster: Cluster, delay_ms: float) -> None:
    """Start a relay in each host, then route the host's own packets for the cluster subnet through it."""
    set_mtu(cluster, DELAYED_MTU)
    relay = Path(__file__).with_name("delayline.py")
    for h in cluster.members:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, sys.executable, str(relay), DELAY_DEVICE, str(delay_ms)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        cluster.delay_pids.append(proc.pid)
        cluster.delay_ms = delay_ms
        cluster._save()  # recorded at once: teardown also ends every process left in the namespace
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            proc.kill()
            raise RuntimeError(f"delay relay in {h.netns} did not start: {line or 'no answer in 20 s'}")
        cluster.exec(h, ["ip", "link", "set", DELAY_DEVICE, "mtu", str(DELAYED_MTU), "up"])
        for key in (
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            f"net.ipv4.conf.{DELAY_DEVICE}.rp_filter=0",
            # the relay hands back packets whose source is this host's own address
            f"net.ipv4.conf.{DELAY_DEVICE}.accept_local=1",
        ):
            cluster.exec(h, ["sysctl", "-q", "-w", key])
        cluster.exec(
            h,
            [
                "ip",
                "route",
                "add",
                f"{cluster.subnet}.0/24",
                "dev",
                DELAY_DEVICE,
                "src",
                h.address,
                "table",
                DELAY_TABLE,
            ],
        )
        # `iif lo` is what the host sends itself; what the relay writes back arrives on the TUN device
        # and takes the main table out of eth0.
        cluster.exec(
            h,
            [
                "ip",
                "rule",
                "add",
                "pref",
                DELAY_TABLE,
                "iif",
                "lo",
                "to",
                f"{cluster.subnet}.0/24",
                "lookup",
                DELAY_TABLE,
            ],
        )


def delay_off(cluster: Cluster) -> None:
    for h in cluster.members:
        cluster.exec(h, ["ip", "rule", "del", "pref", DELAY_TABLE], check=False)
    for pid in cluster.delay_pids:
        if "delayline.py" in cmdline(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    for pid in cluster.delay_pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    if cluster.delay_pids:
        set_mtu(cluster, PLAIN_MTU)
    cluster.delay_pids, cluster.delay_ms = [], None
    cluster._save()


def set_mtu(cluster: Cluster, mtu: int) -> None:
    # Host ends and bridge ports first: a bridge's MTU cannot exceed its ports'.
    for h in cluster.members:
        cluster.exec(h, ["ip", "link", "set", "eth0", "mtu", str(mtu)])
        run(["ip", "link", "set", h.veth, "mtu", str(mtu)])
    run(["ip", "link", "set", cluster.bridge, "mtu", str(mtu)])
