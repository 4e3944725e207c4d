"""The pods of `sdzero k8s` on two namespace hosts, started as Kubernetes starts them: the manifest's own
container command and env, JOB_COMPLETION_INDEX, the pod's hostname (a UTS namespace) and the pod DNS
names in the hosts file (what kubelet writes, and what the headless Service answers). One pod is sent
SIGTERM (Kubernetes' preemption): every rank checkpoints and both pods exit 143; replacement pods with the
same manifest resume (`--resume auto`) and finish with the losses of an uninterrupted 1-host run."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from cluster.launching import LOSS_RTOL, REFERENCE_STEPS, assert_same_losses, finish, start, wait_for_step

from sdzero.checkpoint import checkpointer as ck
from sdzero.cluster.k8s import K8sJob, pod_command
from sdzero.telemetry.metrics import read_metrics

pytestmark = pytest.mark.multinode

JOB = "sdz"


@pytest.fixture
def pod_dns(cluster):
    """Each host's /etc/hosts as kubelet and the headless Service make it (`ip netns exec` mounts it), and a
    resolv.conf naming 127.0.0.1 as the hosts' sshd get (tests/cluster/sshd.py): with the machine's own, which
    names a server no namespace reaches, every lookup outside the hosts file (c10d's reverse lookup of each
    store connection) waited 10 s for the resolver's timeout, 20 s of every pod's start."""
    lines = "".join(
        f"{h.address} {JOB}-{i}.{JOB}.default.svc.cluster.local {JOB}-{i}.{JOB} {JOB}-{i}\n"
        for i, h in enumerate(cluster.members)
    )
    made = []
    for h in cluster.members:
        folder = Path("/etc/netns") / h.netns
        if folder.exists():
            pytest.skip(f"{folder} exists already; not overwriting it")
        folder.mkdir(parents=True)
        made.append(folder)
        (folder / "hosts").write_text("127.0.0.1 localhost\n" + lines)
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    yield
    for folder in made:
        shutil.rmtree(folder)


def start_pod(
    cluster,
    index: int,
    command: list[str],
    env: dict[str, str],
    log: Path,
    cwd: Path,
    private: tuple[Path, Path] | None = None,
):
    """A pod: its own network (the host's namespace), hostname <job>-<index>, the manifest's command;
    `private` = (folder, over) mounts `folder` over `over` for this pod only (a volume it alone sees)."""
    host = cluster.members[index]
    setup = f"hostname {JOB}-{index}"
    if private:
        setup += f" && mkdir -p {private[0]} {private[1]} && mount --bind {private[0]} {private[1]}"
    pod = [
        "ip",
        "netns",
        "exec",
        host.netns,
        "unshare",
        "--uts",
        "--mount",
        "bash",
        "-c",
        f'{setup} && exec "$@"',
        "pod",
        *command,
    ]
    return start(pod, log, cwd, env={**env, "JOB_COMPLETION_INDEX": str(index)})


def test_pods_train_take_sigterm_and_resume(cluster, pod_dns, args, reference, tmp_path):
    out = tmp_path / "run"
    job = K8sJob(
        nodes=2,
        gpus_per_node=1,
        name=JOB,
        gpus=False,
        mount_path=str(tmp_path),
        train_args=args(out, REFERENCE_STEPS, "--dist-timeout-s", "60"),
    )
    command, env = pod_command(job)
    command[command.index("-u") - 1] = sys.executable  # the image's `python`: this venv's

    pods = [start_pod(cluster, i, command, env, tmp_path / f"pod{i}.log", tmp_path) for i in (1, 0)][::-1]
    try:
        wait_for_step(out, 2, pods[0])
        pods[1].send_signal(signal.SIGTERM)  # kubelet preempts pod 1 only: its PID 1 gets SIGTERM
    except BaseException:
        for p in pods:
            os.killpg(p.pid, signal.SIGKILL)
        raise
    stopped = [finish(p, timeout=180) for p in pods]
    first = read_metrics(out / "metrics.jsonl")
    saved = [m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out))]
    assert [code for code, _ in stopped] == [143, 143], stopped[1][1][-3000:]
    assert "SIGTERM on sdz-1" in stopped[1][1] and saved and saved[-1] < REFERENCE_STEPS
    assert {r["world_size"] for r in first} == {2}
    assert_same_losses([r["loss"] for r in first][: saved[-1]], reference[: saved[-1]], LOSS_RTOL)

    # The Job controller replaces both pods (podFailurePolicy: exit 143 is ignored) with the same manifest.
    again = [start_pod(cluster, i, command, env, tmp_path / f"again{i}.log", tmp_path) for i in (0, 1)]
    resumed = [finish(p, timeout=300) for p in again]
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(saved[-1] + 1, REFERENCE_STEPS + 1))
    assert_same_losses([r["loss"] for r in rows], reference[saved[-1] :], LOSS_RTOL)


def test_a_pod_without_the_shared_volume_is_named(cluster, pod_dns, args, tmp_path):
    """Pod 1 mounts a private folder where the others see the shared output folder: the trainer's start-up
    check stops every rank with one line naming it, before any model is loaded."""
    out = tmp_path / "run"
    job = K8sJob(
        nodes=2,
        gpus_per_node=1,
        name=JOB,
        gpus=False,
        mount_path=str(tmp_path),
        train_args=args(out, REFERENCE_STEPS, "--dist-timeout-s", "60"),
    )
    command, env = pod_command(job)
    command[command.index("-u") - 1] = sys.executable
    private = (tmp_path / "private", out)
    pods = [
        start_pod(cluster, i, command, env, tmp_path / f"pod{i}.log", tmp_path, private if i else None)
        for i in (0, 1)
    ]
    done = [finish(p, timeout=180) for p in pods]
    assert [code for code, _ in done] == [2, 2], done[0][1][-3000:]
    errors = [line for line in done[0][1].splitlines() if line.startswith("sdzero: error:")]
    assert errors == [
        f"sdzero: error: --output-dir {out}: node {JOB}-1 does not share it with node {JOB}-0 "
        "(rank 0): a token written there by one was not readable by the other. Every node must "
        "mount the same shared folder (NFS, Lustre, a ReadWriteMany volume), or checkpoints and "
        "resume diverge"
    ], done[0][1][-3000:]
    assert not (out / "metrics.jsonl").exists()
