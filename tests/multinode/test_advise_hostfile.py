"""`sdzero advise --hostfile` from a machine without an accelerator (a login node), the two namespace hosts
in the hostfile: the trials run on the hostfile's first host through the launcher, and the scale-out check
runs its 1-host leg there with that host's slots and its multi-host leg across both hosts.

Every rank records where it ran (its host name, rank, world size and folder) through a sitecustomize that
only the launcher's forwarded values put on its path, so a rank started on this machine directly, or on
the wrong host, shows up as such (a rank's child interpreters record too, with its rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdzero.cluster.launch_command import REPO_ROOT

pytestmark = pytest.mark.multinode

RECORD = """import json, os, socket

if "RANK" in os.environ:
    try:
        with open(os.path.join({out!r}, socket.gethostname() + "." + str(os.getpid()) + ".json"), "x") as f:
            json.dump({{"host": socket.gethostname(), "cwd": os.getcwd(), "rank": int(os.environ["RANK"]),
                       "world_size": int(os.environ.get("WORLD_SIZE", "0"))}}, f)
    except FileExistsError:
        pass
"""
ADVISE = [sys.executable, "-c", "from advisor.cli import main; main()", "advise"]
"""`sdzero advise` (the console script's entry point) in this interpreter."""


@pytest.fixture(scope="module")
def advised(cluster, tiny_model, synth_data, tmp_path_factory):
    from advisor.measure.profile import device_support

    if device_support()["device"] != "cpu":
        pytest.skip("this machine has an accelerator: its trials run here, not on the hostfile's first host")
    base = tmp_path_factory.mktemp("advise-hostfile")
    work, records, hooks = base / "work", base / "records", base / "hooks"
    for folder in (work, records, hooks):
        folder.mkdir()
    (hooks / "sitecustomize.py").write_text(RECORD.format(out=str(records)))
    (work / ".deepspeed_env").write_text(f"PYTHONPATH={hooks}{os.pathsep}{REPO_ROOT}\n")
    out = work / "out"
    command = [*ADVISE, "--model", str(tiny_model), "--data", str(synth_data), "--hostfile"]
    command += [str(cluster.hostfile), "--out", str(out), "--budget-minutes", "1", "--max-nodes", "4"]
    started = time.monotonic()
    done = subprocess.run(
        command,
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=480,
    )
    ranks = [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]
    return {"done": done, "out": out, "ranks": ranks, "wall_s": time.monotonic() - started}


def ranks_under(advised, folder: Path) -> list[dict]:
    return [r for r in advised["ranks"] if Path(r["cwd"]).is_relative_to(folder)]


def placed(records: list[dict]) -> set[tuple[str, int, int]]:
    """(host, rank, world size) of every rank that recorded: a rank and its child interpreters once."""
    return {(r["host"], r["rank"], r["world_size"]) for r in records}


def test_advise_ends_with_a_scaleout_check(advised):
    done = advised["done"]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    check = json.loads((advised["out"] / "recommendation.json").read_text())["scaleout_check"]
    assert "failed" not in check and "skipped" not in check, check
    assert check["measured_step_s"] > 0 and check["predicted_step_s"] > 0


def test_the_trials_run_on_the_first_host_through_the_launcher(advised, cluster):
    first = cluster.members[0]
    said = (advised["out"] / "advise.log").read_text()
    assert f"trials run on {first.address} ({cluster.slots} ranks) through the launcher" in said
    trials = ranks_under(advised, advised["out"] / "profile" / "trials")
    assert trials, advised["done"].stdout[-3000:]
    assert placed(trials) == {(first.hostname, rank, cluster.slots) for rank in range(cluster.slots)}
    log = next((advised["out"] / "profile" / "trials").rglob("log.txt")).read_text()
    assert "cmd = pdsh" in log and first.address in log and cluster.members[1].address not in log


def test_the_scaleout_check_runs_one_host_then_both(advised, cluster):
    first, second = cluster.members[:2]
    check = json.loads((advised["out"] / "recommendation.json").read_text())["scaleout_check"]
    assert check["one_host_leg"]["host"] == first.address
    assert check["one_host_leg"]["ranks"] == cluster.slots
    assert check["multi_host_leg"] == {
        "hosts": [first.address, second.address],
        "ranks_per_host": cluster.slots,
    }
    scaleout = advised["out"] / "scaleout"
    one_host = [r for r in ranks_under(advised, scaleout) if r["cwd"].endswith("-1host")]
    slots = cluster.slots
    assert placed(one_host) == {(first.hostname, rank, slots) for rank in range(slots)}
    both = [r for r in ranks_under(advised, scaleout) if r["cwd"].endswith("-2hosts")]
    hosts = [first.hostname] * slots + [second.hostname] * slots
    assert placed(both) == {(host, rank, 2 * slots) for rank, host in enumerate(hosts)}
    print(f"advise --hostfile: {advised['wall_s']:.0f} s")
