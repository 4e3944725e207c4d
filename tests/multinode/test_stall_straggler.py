"""A stuck rank and a slow host named while the run is on, across two namespace hosts (`sdzero launch`).

- A rank SIGSTOPped on the second host: within --stall-seconds + 15 s the watcher names it (rank, host,
  phase, step) in stall.json and on the terminal, and `sdzero launch` exits with EXIT_STALLED (142), the
  code the Slurm script requeues; nothing of the launch is left running.
- The ranks of the second host slowed in their data phase (a slow disk under its loader): the host is named
  in metrics.jsonl (`straggler`), once on the terminal, and in the training report with its plot.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from cluster.launching import SDZERO, finish, ok, start, wait_for_step

from advisor.report.build import write_training_report
from sdzero.cluster.launch_command import REPO_ROOT
from sdzero.process.stall_watch import EXIT_STALLED, STALL_FILE
from sdzero.telemetry.metrics import read_metrics
from sdzero.telemetry.progress import PHASES

pytestmark = pytest.mark.multinode

STALL_S = 10
NAMED_WITHIN_S = STALL_S + 15
SUPPORT = REPO_ROOT / "tests" / "support"


def test_a_stopped_rank_is_named_and_the_launch_exits_restartable(cluster, args, tmp_path):
    work, out = tmp_path, tmp_path / "run"
    run_args = args(out, 500, "--stall-seconds", str(STALL_S), "--dist-timeout-s", "300")
    proc = start(
        [SDZERO, "launch", "--hostfile", str(cluster.hostfile), "--", *run_args], work / "l.log", work
    )
    victim_host = cluster.members[1]
    try:
        wait_for_step(out, 3, proc)
        victims = cluster.rank_pids(victim_host)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGSTOP)
        stopped_at = time.time()
        code, log = finish(proc, timeout=NAMED_WITHIN_S + 60)
    finally:
        for pid in cluster.rank_pids(victim_host):  # whatever the verdict, nothing left stopped
            os.kill(pid, signal.SIGKILL)
    stall = json.loads((out / STALL_FILE).read_text())
    named_after = (out / STALL_FILE).stat().st_mtime - stopped_at
    assert STALL_S <= named_after <= NAMED_WITHIN_S, named_after
    assert code == EXIT_STALLED, log[-4000:]
    held = [g for g in stall["groups"] if g["holding_the_job"]]
    assert len(held) == 1 and held[0]["ranks"] == [1] and held[0]["hosts"] == [victim_host.hostname], stall
    last_step = max(r["step"] for r in read_metrics(out / "metrics.jsonl"))
    assert held[0]["phase"] in PHASES and held[0]["step"] in (last_step, last_step + 1), (stall, last_step)
    line = stall["summary"]
    assert line.startswith(f"rank 1 ({victim_host.hostname}) in {held[0]['phase']} at step "), line
    assert "(not responding); rank 0 (" in line, line
    assert f"sdzero: stall: no rank advanced for {STALL_S} s" in log and line in log
    assert f"exit {EXIT_STALLED}: restart with --resume auto" in log
    print(f"stall line: {line}")


def test_a_slow_host_is_named_in_metrics_terminal_and_report(cluster, args, tmp_path):
    work, out = tmp_path, tmp_path / "run"
    slow = cluster.members[1]
    env = {
        "SDZERO_CALLBACKS": "fault_callbacks:from_env",
        "PYTHONPATH": f"{SUPPORT}{os.pathsep}{REPO_ROOT}",
        "SDZERO_TEST_SLOW_HOST": f"{slow.hostname}:0.25",
    }
    (work / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    run_args = args(out, 12, "--straggler-every", "3")
    log = ok(
        finish(
            start(
                [SDZERO, "launch", "--hostfile", str(cluster.hostfile), "--", *run_args], work / "l.log", work
            )
        )
    )
    records = read_metrics(out / "metrics.jsonl")
    shared = [r for r in records if "host_compute_s" in r]
    assert [r["step"] for r in shared] == [3, 6, 9, 12]
    assert all(set(r["host_compute_s"]) == {h.hostname for h in cluster.members} for r in shared)
    named = [r["straggler"] for r in records if r.get("straggler")]
    assert named and all(n["host"] == slow.hostname and n["ranks"] == [1] for n in named), named
    assert named[0]["slower_by"] > 0.5 and 0 < named[0]["wait_share"] < 1
    lines = [line for line in log.splitlines() if f"slow host {slow.hostname} (rank 1)" in line]
    assert len(lines) == 1, log[-4000:]  # one line for the run, not one per step
    page = write_training_report(out, work / "report.html").read_text()
    assert f"Slow host: {slow.hostname} (ranks 1)" in page and 'id="fig-hosts"' in page
    print(f"straggler line: {lines[0][lines[0].index('slow host') :]}")
