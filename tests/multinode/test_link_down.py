"""A link taken down mid-run, across two namespace hosts (`sdzero launch`): the second host's leg to the
bridge is set down after step 3. The ranks on both hosts wait in a collective and both watchers beat on,
so only the link check (sdzero.process.link_check: can the host still reach the rendezvous?) says which
host is cut off. Within --stall-seconds + 15 s, far under the collective timeout, stall.json names it and
`sdzero launch` exits 142; with the link back, `--resume auto` continues bit-exactly: every resumed step's
loss equals an uninterrupted run's on the same two hosts.
"""

from __future__ import annotations

import json
import time

import pytest
from cluster.launching import REFERENCE_STEPS, SDZERO, finish, launch, losses, ok, start, wait_for_step
from cluster.netns import run

from sdzero.checkpoint import checkpointer as ck
from sdzero.process.stall_watch import EXIT_STALLED, STALL_FILE
from sdzero.telemetry.metrics import read_metrics

pytestmark = pytest.mark.multinode

STALL_S = 10
NAMED_WITHIN_S = STALL_S + 15
DIST_TIMEOUT_S = 300
"""The collective timeout the job would otherwise wait for: far beyond NAMED_WITHIN_S."""


def test_a_link_taken_down_ends_the_run_naming_its_host_and_resume_is_exact(cluster, args, tmp_path):
    work, out = tmp_path, tmp_path / "run"
    victim = cluster.members[1]
    long_run = args(
        out,
        200,
        "--checkpoint-every",
        "2",
        "--stall-seconds",
        str(STALL_S),
        "--dist-timeout-s",
        str(DIST_TIMEOUT_S),
    )
    proc = start(
        [SDZERO, "launch", "--hostfile", str(cluster.hostfile), "--", *long_run], work / "l.log", work
    )
    try:
        wait_for_step(out, 3, proc)
        run(["ip", "link", "set", victim.veth, "down"])
        cut_at = time.time()
        code, log = finish(proc, timeout=NAMED_WITHIN_S + 60)
    finally:
        run(["ip", "link", "set", victim.veth, "up"])
    stall = json.loads((out / STALL_FILE).read_text())
    named_after = (out / STALL_FILE).stat().st_mtime - cut_at
    assert STALL_S <= named_after <= NAMED_WITHIN_S, named_after
    assert code == EXIT_STALLED, log[-4000:]
    held = [g for g in stall["groups"] if g["holding_the_job"]]
    assert len(held) == 1 and held[0]["hosts"] == [victim.hostname] and held[0]["link_down"], stall
    line = stall["summary"]
    assert line.startswith(f"rank 1 ({victim.hostname}) in "), line
    assert "(its host cannot reach the rendezvous: link down)" in line and line in log
    deadline = time.monotonic() + 15
    while cluster.rank_pids(victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not cluster.rank_pids(victim), "the cut-off rank is still running"
    print(f"stall line: {line}")

    cut = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}
    last = max(m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out)))
    if last >= REFERENCE_STEPS:
        pytest.fail(f"the cut run checkpointed step {last}, at or past the resume target; cut sooner")
    ok(launch(cluster.hostfile, args(out, REFERENCE_STEPS, "--resume", "auto"), work / "resume.log", work))
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(last + 1, REFERENCE_STEPS + 1))
    whole = work / "whole"
    ok(launch(cluster.hostfile, args(whole, REFERENCE_STEPS), work / "whole.log", work))
    assert [r["loss"] for r in resumed] == losses(whole)[last:]  # bit-exact, not within a tolerance
    assert all(cut[s] == losses(whole)[s - 1] for s in cut if s > last)  # the cut run's own steps too
