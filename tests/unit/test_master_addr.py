"""--master-addr: IPv6 literals (bare or bracketed) reach the ranks as torch's rendezvous wants them;
anything a remote shell could interpret is still refused before any ssh."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sdzero.cluster import hostfile as hosts
from sdzero.errors import UserError


def plan(tmp_path: Path, addr: str, route: str):
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n")
    calls: list[str] = []

    def runner(host: str, command: str) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(["ssh", host], 0, route, "")

    return hosts.plan_launch(tmp_path / "hosts", [], master_addr=addr, workdir=tmp_path, runner=runner), calls


@pytest.mark.parametrize(
    ("addr", "given"),
    [("fd00::1", "fd00::1"), ("[fd00::1]", "fd00::1"), ("::1", "::1"), ("fe80::1%eth0", "fe80::1%eth0")],
)
def test_ipv6_master_addr_is_accepted_unbracketed_and_routed_with_ip_6(tmp_path, addr, given):
    launch, calls = plan(tmp_path, addr, "fd00::1 via fe80::1 dev eth0 proto static\n")
    assert launch.master_addr == given
    assert launch.interface == "eth0"
    assert calls[-1].startswith(f"ip -o -6 route get {given.partition('%')[0]};")
    cmd = launch.command
    assert cmd[cmd.index("--master_addr") + 1] == given  # MASTER_ADDR for TCPStore: no brackets


def test_ipv6_master_addr_owned_by_the_master_finds_its_interface(tmp_path):
    route = "local ::1 dev lo table local proto kernel\n2: ens5    inet6 fd00::1/64 scope global\n"
    launch, _ = plan(tmp_path, "fd00::1", route)
    assert launch.interface == "ens5"


@pytest.mark.parametrize(
    "addr",
    [
        "fd00::1;reboot",
        "[fd00::1",
        "fd00:::1",
        "fe80::1%$(id)",
        "fe80::1%eth0;id",
        "[10.0.0.1]",
        "a:b",
        "$(id)",
    ],
)
def test_junk_master_addr_is_refused_in_one_line(tmp_path, addr):
    with pytest.raises(UserError) as err:
        plan(tmp_path, addr, "")
    assert "a host name or IP address only" in str(err.value) and "\n" not in str(err.value)
