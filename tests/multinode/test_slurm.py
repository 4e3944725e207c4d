"""`sdzero slurm` under a real Slurm: slurmctld, one slurmd per namespace host, munge (tests/cluster/slurm.py).

Each job is written by `sdzero slurm` and submitted with `sbatch` from its working folder, as a user does;
what Slurm recorded is read back with `sacct --completion`, `squeue` and `scontrol`. Three hosts; the
runs are short (the tiny model, fp32 ZeRO-2 with torch's AdamW, so resumes compare exactly):

- 2 nodes, in a working folder and an output folder full of shell and #SBATCH metacharacters: COMPLETED;
  its losses are the uninterrupted run the preempted one must match;
- 3 nodes: COMPLETED; the uninterrupted run the node-failure chain is compared with;
- 2 nodes, SIGUSR1 to the batch shell (`scancel --signal=USR1 --batch`): save, requeue, resume, and the
  loss curve equals the uninterrupted one exactly;
- 3 nodes, one node lost (stopped, set DOWN, powered off): the job ends, no rank survives anywhere, and a resubmission
  on the 2 nodes left continues with --resume-elastic;
- `sdzero doctor` in a batch job, no hostfile: the allocation's nodes, one with a private output folder.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_helpers import exact_config
from cluster import Cluster, ClusterUnavailable
from cluster import slurm as slurm_cluster
from cluster import unavailable_reason as cluster_unavailable
from cluster.faults import private_folder
from cluster.launching import LOSS_RTOL, SDZERO, assert_same_losses
from cluster.slurm import KILL_WAIT_S, Slurm
from launch import write_config

from sdzero.checkpoint import checkpointer as ck
from sdzero.telemetry.metrics import read_metrics

TWO_NODE_STEPS = 16
"""A step takes about 0.2 s here once started: the preemption warning after step 2 leaves the run many
step boundaries to save at, and the job still ends in seconds."""
THREE_NODE_STEPS = 10
ODD = "work dir $HOME;x&y'q #1 %j"
"""A working folder with what a shell and sbatch's directive parser treat specially: blanks, $, ;, &, ',
#, and a % that sbatch would expand in the log's file name."""
ODD_OUT = 'out "q" $(touch pwned) `touch pwned2`; x'
"""An output folder with what only the script body sees (shell-quoted there): quotes, substitutions."""
JOB_END_BOUND_S = KILL_WAIT_S + 25
"""After a node is set DOWN: Slurm's SIGTERM to the job, KillWait to SIGKILL, the batch shell's end. Ranks
left waiting on their lost peers would overrun it by minutes (the collectives' own timeout)."""


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    reason = cluster_unavailable() or slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm on namespace hosts here: {reason}")
    try:
        with Cluster(hosts=3, slots=1) as made, slurm_cluster.running(made) as running:
            yield running
    except ClusterUnavailable as exc:
        pytest.skip(f"no namespace cluster on this machine: {exc}")


@pytest.fixture(autouse=True)
def every_node_idle(slurm: Slurm) -> None:
    """`sinfo` shows every host idle before each test (a test that took a node down gives it back)."""
    slurm.restore()


@pytest.fixture(scope="module")
def micro6(tmp_path_factory) -> Path:
    """2 ranks x micro-batch 6 = the 3-node runs' global batch of 12 (3 x 4): the same samples per step."""
    config = {**exact_config(2), "train_micro_batch_size_per_gpu": 6}
    return write_config(tmp_path_factory.mktemp("slurm-config") / "zero2_fp32_micro6.json", config)


def write_job(folder: Path, nodes: int, train_args: list[str], *options: str) -> Path:
    """`sdzero slurm ... > job.sbatch`, run in `folder` (the job's working folder) as a user would."""
    rendered = subprocess.run(
        [
            SDZERO,
            "slurm",
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            "1",
            "--no-gpus",
            *options,
            "--",
            *train_args,
        ],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr
    script = folder / "job.sbatch"
    script.write_text(rendered.stdout)
    return script


def job_log(folder: Path, job_id: int) -> str:
    return (folder / f"slurm-sdzero-{job_id}.log").read_text(errors="replace")


def states(slurm: Slurm, job_id: int) -> list[tuple[str, str]]:
    return [(r["state"], r["exitcode"]) for r in slurm.completions(job_id)]


def losses(*files: Path) -> list[float]:
    return [r["loss"] for f in files for r in read_metrics(f)]


def complete_steps(out: Path) -> list[int]:
    return sorted(m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out)))


def wait_for_job_step(slurm: Slurm, job_id: int, out: Path, step: int, timeout_s: float = 240) -> None:
    """Until the job's metrics show `step` (its ranks are Slurm's, not this process's children)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # not written yet, or a line half-written
            if any(r["step"] >= step for r in read_metrics(out / "metrics.jsonl")):
                return
        if slurm.job_state(job_id) == "GONE":
            raise AssertionError(f"job {job_id} ended before step {step}: {states(slurm, job_id)}")
        time.sleep(0.1)
    raise AssertionError(f"job {job_id}: no step {step} within {timeout_s} s")


def run_job(slurm: Slurm, folder: Path, nodes: int, train_args: list[str]) -> tuple[int, float]:
    script = write_job(folder, nodes, train_args)
    start = time.monotonic()
    job_id = slurm.sbatch(script, folder)
    slurm.wait_gone(job_id, 300)
    return job_id, time.monotonic() - start


@pytest.fixture(scope="module")
def two_nodes(slurm, args, tmp_path_factory) -> dict:
    """The 2-node job in the odd folders, uninterrupted."""
    work = tmp_path_factory.mktemp("slurm-odd") / ODD
    work.mkdir()
    out = work / ODD_OUT
    job_id, wall_s = run_job(slurm, work, 2, args(out, TWO_NODE_STEPS, "--checkpoint-every", "8"))
    print(f"2-node job {job_id}: {wall_s:.1f} s, sacct {states(slurm, job_id)}")
    return {"id": job_id, "work": work, "out": out, "losses": losses(out / "metrics.jsonl")}


@pytest.fixture(scope="module")
def three_nodes(slurm, args, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("slurm-three")
    out = work / "run"
    job_id, wall_s = run_job(slurm, work, 3, args(out, THREE_NODE_STEPS, "--checkpoint-every", "5"))
    print(f"3-node job {job_id}: {wall_s:.1f} s, sacct {states(slurm, job_id)}")
    return {"id": job_id, "work": work, "out": out, "losses": losses(out / "metrics.jsonl")}


def test_two_node_job_in_odd_folders_completes(slurm, two_nodes):
    job_id, work, out = two_nodes["id"], two_nodes["work"], two_nodes["out"]
    log = job_log(work, job_id)  # the #SBATCH --output pattern: quoted, the folder's own % kept literal
    assert states(slurm, job_id) == [("COMPLETED", "0:0")], log[-4000:]
    record = slurm.completions(job_id)[0]
    assert record["nodelist"] == ",".join(slurm.nodes[:2])
    assert "sdzero: ranks ended with exit 0" in log
    # The ranks came from srun, one task per node, numbered by Slurm: the hostfile the script wrote from
    # the allocation, and a world of 2 in every metrics row.
    assert (out / f"hostfile.{job_id}").read_text() == "".join(f"{n} slots=1\n" for n in slurm.nodes[:2])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, TWO_NODE_STEPS + 1))
    assert {r["world_size"] for r in rows} == {2}
    assert complete_steps(out) == [8, 16]
    assert f"master {slurm.nodes[0]}:" in log
    # Nothing in the folder names ran as a command.
    assert not list(work.parent.rglob("pwned*")), "a folder name was executed"


def test_three_node_job_completes(slurm, three_nodes):
    job_id, out = three_nodes["id"], three_nodes["out"]
    log = job_log(three_nodes["work"], job_id)
    assert states(slurm, job_id) == [("COMPLETED", "0:0")], log[-4000:]
    assert (out / f"hostfile.{job_id}").read_text() == "".join(f"{n} slots=1\n" for n in slurm.nodes)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, THREE_NODE_STEPS + 1))
    assert {r["world_size"] for r in rows} == {3}
    assert complete_steps(out) == [5, 10]


def test_preemption_warning_saves_requeues_and_resumes_exactly(slurm, args, two_nodes, tmp_path):
    out = tmp_path / "run"
    script = write_job(tmp_path, 2, args(out, TWO_NODE_STEPS, "--checkpoint-every", "8"))
    start = time.monotonic()
    job_id = slurm.sbatch(script, tmp_path)
    wait_for_job_step(slurm, job_id, out, 2)
    # What `#SBATCH --signal=B:USR1@LEAD` does at the time limit, and a preemption notice: USR1 to the
    # batch shell alone, which forwards it to srun and so to every rank.
    slurm.client("scancel", "--signal=USR1", "--batch", str(job_id))
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while (state := slurm.job_state(job_id)) != "GONE":
        shown = slurm.client("squeue", "--noheader", "--jobs", str(job_id), "--format=%T %r", check=False)
        if (line := shown.stdout.strip()) and (not seen or seen[-1] != line):
            seen.append(line)
        assert time.monotonic() < deadline, (state, seen)
        time.sleep(0.2)
    wall_s = time.monotonic() - start
    log = job_log(tmp_path, job_id)
    print(f"preempted job {job_id}: {wall_s:.1f} s; squeue {seen}; sacct {states(slurm, job_id)}")

    assert "sdzero: got SIGUSR1" in log and f"requeueing job {job_id}" in log, log[-4000:]
    saved = re.findall(r"preempted: checkpoint of step (\d+) committed", log)
    assert len(saved) == 1, log[-4000:]  # rank 0 reports the save the ranks agreed on
    step = int(saved[0])
    assert 2 <= step < TWO_NODE_STEPS
    # Slurm's side: the same job id twice, the requeue held back for cred_expire ("BeginTime"), a restart.
    assert "PENDING BeginTime" in seen, seen
    assert states(slurm, job_id) == [("PENDING", "0:0"), ("COMPLETED", "0:0")], log[-4000:]
    assert "Restarts=1 " in slurm.client("scontrol", "show", "job", str(job_id)).stdout
    assert f"sdzero: job {job_id} start 1:" in log
    assert f"resumed from {ck.checkpoint_root(out) / ck.step_tag(step)} (step {step})" in log
    # The loss curve: the first start's steps 1..k, then the requeued start's k+1..16, equal to the
    # uninterrupted run's, bit for bit.
    first, second = read_metrics(out / "metrics.1.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in first] == list(range(1, step + 1))
    assert [r["step"] for r in second] == list(range(step + 1, TWO_NODE_STEPS + 1))
    chain = losses(out / "metrics.1.jsonl", out / "metrics.jsonl")
    assert chain == two_nodes["losses"], list(zip(chain, two_nodes["losses"], strict=True))
    print("requeued vs uninterrupted losses (equal):", chain)


def test_scancel_ends_the_job_for_good_after_a_save(slurm, args, tmp_path):
    """A user's `scancel` (SIGTERM to the batch shell and the ranks, SIGKILL KillWait later): the ranks
    save at the next step boundary, and the job ends CANCELLED, not requeued by its own script."""
    out = tmp_path / "run"
    job_id = slurm.sbatch(write_job(tmp_path, 2, args(out, TWO_NODE_STEPS)), tmp_path)
    wait_for_job_step(slurm, job_id, out, 2)
    start = time.monotonic()
    slurm.client("scancel", str(job_id))
    slurm.wait_gone(job_id, 120)
    ended_s = time.monotonic() - start
    log = job_log(tmp_path, job_id)
    print(f"cancelled job {job_id}: ended {ended_s:.1f} s after scancel; sacct {states(slurm, job_id)}")
    # One record: a requeue by the script would have put the job back in the queue before it left it.
    assert [s for s, _ in states(slurm, job_id)] == ["CANCELLED"], log[-4000:]
    assert "sdzero: got SIGTERM" in log and "requeueing" not in log, log[-4000:]
    assert not any(slurm.cluster.rank_pids(h) for h in slurm.cluster.members)
    saved = re.findall(r"preempted: checkpoint of step (\d+) committed", log)
    assert saved and complete_steps(out) == [int(saved[0])], log[-4000:]


def test_node_down_ends_the_job_and_the_rest_continue_elastic(slurm, args, three_nodes, micro6, tmp_path):
    cluster = slurm.cluster
    lost = cluster.members[2]
    out = tmp_path / "run"
    train = args(out, THREE_NODE_STEPS, "--checkpoint-every", "1")
    job_id = slurm.sbatch(write_job(tmp_path, 3, train), tmp_path)
    wait_for_job_step(slurm, job_id, out, 2)
    # The node stops, is set DOWN, and powers off (its slurmd and ranks).
    down_at = time.monotonic()
    slurm.lose_node(lost, "lost (test)")
    while (state := slurm.job_state(job_id)) in ("RUNNING", "COMPLETING") or any(
        cluster.rank_pids(h) for h in cluster.members
    ):
        assert time.monotonic() - down_at < JOB_END_BOUND_S, (
            state,
            [cluster.rank_pids(h) for h in cluster.members],
        )
        time.sleep(0.2)
    ended_s = time.monotonic() - down_at
    log = job_log(tmp_path, job_id)
    print("\n".join(x for x in log.splitlines() if x.startswith(("srun:", "slurmstepd", "sdzero:"))))
    print(
        f"node-down job {job_id}: ended {ended_s:.1f} s after DOWN; now {state}; sacct {states(slurm, job_id)}"
    )
    assert states(slurm, job_id) == [("NODE_FAIL", "0:0")], log[-4000:]
    assert not any(cluster.rank_pids(h) for h in cluster.members)
    assert slurm.node_states()[lost.hostname].startswith("down")
    # The script saw SIGTERM, not a warning: Slurm requeued the job itself (#SBATCH --requeue), and with
    # 3 nodes no longer there it waits. The user cancels it.
    assert "not requeued by this script" in log and "requeueing" not in log, log[-4000:]
    assert state == "PENDING", state
    slurm.client("scancel", str(job_id))
    slurm.wait_gone(job_id, 60)
    assert [s for s, _ in states(slurm, job_id)] == ["NODE_FAIL", "CANCELLED"]
    # The newest complete checkpoint: the save of the step that was running when the node went may be
    # half-written (left for the resume to pass over).
    saved = complete_steps(out)
    assert saved and saved[-1] < THREE_NODE_STEPS, saved

    # ... and resubmits on the 2 nodes left, the same global batch (2 x 6 = 3 x 4), --resume-elastic.
    elastic = [*args(out, THREE_NODE_STEPS, "--checkpoint-every", "5", "--resume-elastic")]
    elastic[elastic.index("--deepspeed_config") + 1] = str(micro6)
    start = time.monotonic()
    second = slurm.sbatch(write_job(tmp_path, 2, elastic), tmp_path)
    slurm.wait_gone(second, 300)
    log2 = job_log(tmp_path, second)
    print(f"elastic resubmission {second}: {time.monotonic() - start:.1f} s; sacct {states(slurm, second)}")
    assert states(slurm, second) == [("COMPLETED", "0:0")], log2[-4000:]
    assert lost.hostname not in slurm.completions(second)[0]["nodelist"]
    step = saved[-1]
    assert f"resumed from {ck.checkpoint_root(out) / ck.step_tag(step)} (step {step}, 3 -> 2 ranks" in log2
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(step + 1, THREE_NODE_STEPS + 1))
    assert {r["world_size"] for r in rows} == {2}
    # The same samples and noise per step, summed in another order: the 3-node run's losses, nearly.
    got, want = [r["loss"] for r in rows], three_nodes["losses"][step:]
    print("elastic vs uninterrupted 3-node losses:", list(zip(got, want, strict=True)))
    assert_same_losses(got, want, LOSS_RTOL)


def test_doctor_in_an_allocation_reads_the_nodes_from_slurm(slurm, synth_data, tmp_path):
    cluster = slurm.cluster
    first, private = cluster.members[:2]
    out = tmp_path / "out"
    command = f"{SDZERO} doctor --output-dir {out} --data {synth_data} --probe-mib 1"
    with private_folder(cluster, private, out, tmp_path / "private-out"):
        start = time.monotonic()
        job_id = slurm.sbatch_wrap(
            command, tmp_path, "--nodes=2", "--job-name=doctor", env={"COLUMNS": "250"}
        )
        slurm.wait_gone(job_id, 240)
    wall_s = time.monotonic() - start
    log = (tmp_path / f"slurm-doctor-{job_id}.log").read_text(errors="replace")
    print(f"doctor job {job_id}: {wall_s:.1f} s; sacct {states(slurm, job_id)}")
    # A row per allocated node, named by itself; the third host, outside the allocation, is not checked.
    for host in (first, private):
        assert re.search(rf"│ {re.escape(host.hostname)}\s+│", log), log[-4000:]
    assert cluster.members[2].hostname not in log
    verdict = [line for line in log.splitlines() if line.startswith("verdict:")]
    assert verdict == [
        f"verdict: NOT READY: --output-dir on {private.hostname} is not the same folder as on "
        f"{first.hostname} (a private or different mount): {private.hostname} cannot read the tokens of "
        f"{first.hostname} and {first.hostname} cannot read {private.hostname}'s"
    ], log[-4000:]
    assert states(slurm, job_id) == [("FAILED", "1:0")]  # the doctor's exit 1 on a blocker, as sacct has it
    assert re.search(rf"│ {re.escape(first.hostname)} <-> {re.escape(private.hostname)}\s*│\s*[\d.]+", log)
