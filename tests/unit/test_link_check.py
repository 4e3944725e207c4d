"""The stall watch's link check (sdzero.process.link_check) against a real listening socket, and the
stall line for a host whose link is down (sdzero.process.stall_watch.describe_stall)."""

from __future__ import annotations

import socket
import time

from sdzero.process.link_check import CHECK_AFTER_S, CHECK_EVERY_S, LinkCheck, reaches, rendezvous
from sdzero.process.stall_watch import RankView, describe_stall
from sdzero.telemetry.progress import Snapshot


def view(rank: int, host: str) -> RankView:
    return RankView(
        Snapshot(rank, 100 + rank, host, 7, "gradient reduction and optimizer", 0.0, time.time(), 0), 0.0
    )


def test_the_rendezvous_is_reached_while_it_listens_and_not_after():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = server.getsockname()
    assert rendezvous({"MASTER_ADDR": address[0], "MASTER_PORT": str(address[1])}) == address
    assert rendezvous({"MASTER_ADDR": "x"}) is None
    check = LinkCheck(address)
    assert check.update(idle_s=CHECK_AFTER_S / 2, now=0.0) is None  # a busy host makes no connection
    assert check.update(idle_s=CHECK_AFTER_S, now=0.0) is True
    server.close()
    assert not reaches(address)
    assert check.update(idle_s=CHECK_AFTER_S, now=CHECK_EVERY_S / 2) is True  # not checked again yet
    assert check.update(idle_s=CHECK_AFTER_S, now=CHECK_EVERY_S) is False


def test_the_host_cut_off_holds_the_job_and_the_others_wait():
    views = {0: view(0, "node1"), 1: view(1, "node2")}
    lines, groups = describe_stall(views, now=12.0, cut_off={"node2"})
    assert lines == [
        "rank 1 (node2) in gradient reduction and optimizer at step 7 for 12 s (its host cannot reach the "
        "rendezvous: link down)",
        "rank 0 (node1) waiting in gradient reduction and optimizer at step 7",
    ]
    assert groups[0]["holding_the_job"] and groups[0]["link_down"] and not groups[1]["link_down"]
    # without the check, two ranks in one place: nobody is named
    assert [g["holding_the_job"] for g in describe_stall(views, now=12.0)[1]] == [False]


def test_with_three_hosts_the_one_nobody_reaches_is_named():
    views = {r: view(r, f"node{r + 1}") for r in range(3)}
    lines, groups = describe_stall(views, now=12.0, cut_off={"node2", "node3"})
    assert lines[0].startswith(
        "rank 0 (node1) in gradient reduction and optimizer at step 7 for 12 s (no other"
    )
    assert groups[0]["ranks"] == [0] and groups[0]["link_down"]
