"""Real launches across two namespace "hosts" through `sdzero launch`: DeepSpeed's hostfile launch (pdsh
over ssh) and its Open MPI launcher, checked against 1 host x 2 slots.

The pdsh launch is shared (one launch costs ~30 s on 2 cores): the run is started in a folder whose
.deepspeed_env the user already wrote, the rank on the second host is SIGKILLed after step 3, and the job
must end with a non-zero code on its own; `--resume auto` then continues from step 2's checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
from cluster.launching import (
    LOSS_RTOL,
    REFERENCE_STEPS,
    SDZERO,
    assert_same_losses,
    finish,
    launch,
    losses,
    ok,
    start,
    wait_for_step,
)

from sdzero.checkpoint import checkpointer as ck
from sdzero.telemetry.metrics import read_metrics

pytestmark = pytest.mark.multinode

USER_ENV = "NCCL_DEBUG=WARN\nSDZERO_USER_SETTING=mine\n"
CHECKPOINT_EVERY = 2


@pytest.fixture(scope="module")
def killed_then_resumed(cluster, args, tmp_path_factory):
    work = tmp_path_factory.mktemp("pdsh")
    (work / ".deepspeed_env").write_text(USER_ENV)
    out = work / "run"
    long_run = args(out, 200, "--checkpoint-every", str(CHECKPOINT_EVERY), "--dist-timeout-s", "60")
    proc = start(
        [SDZERO, "launch", "--hostfile", str(cluster.hostfile), "--", *long_run], work / "killed.log", work
    )
    try:
        wait_for_step(out, 3, proc)
        victims = cluster.rank_pids(cluster.members[1])
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    # The launch's own timeout is the hang detector: the dist timeout (60 s) plus the launchers' clean-up.
    killed = finish(proc, timeout=180)
    first_metrics = read_metrics(out / "metrics.jsonl")
    checkpoints = [m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out))]
    resumed = launch(
        cluster.hostfile, args(out, REFERENCE_STEPS, "--resume", "auto"), work / "resume.log", work
    )
    return {
        "work": work,
        "killed": killed,
        "first_metrics": first_metrics,
        "checkpoints": checkpoints,
        "resumed": resumed,
        "resumed_metrics": read_metrics(out / "metrics.jsonl"),
    }


def test_two_hosts_train_like_one_host(killed_then_resumed, reference):
    first = killed_then_resumed["first_metrics"][:3]
    assert {r["world_size"] for r in first} == {2}
    assert_same_losses([r["loss"] for r in first], reference[:3], LOSS_RTOL)


def test_ranks_ran_on_both_hosts(killed_then_resumed, cluster):
    output = ok(killed_then_resumed["resumed"])
    for host in cluster.members:  # pdsh prefixes every line with the host that printed it
        assert f"{host.address}: " in output
    assert output.count("exits successfully") == 2


def test_dead_host_fails_the_whole_job(killed_then_resumed):
    code, output = killed_then_resumed["killed"]
    assert code != 0, output[-3000:]
    assert (
        killed_then_resumed["checkpoints"] and killed_then_resumed["checkpoints"][-1] % CHECKPOINT_EVERY == 0
    )


def test_resume_auto_continues_from_the_last_complete_checkpoint(killed_then_resumed, reference):
    ok(killed_then_resumed["resumed"])
    rows = killed_then_resumed["resumed_metrics"]
    last = killed_then_resumed["checkpoints"][-1]
    if last >= REFERENCE_STEPS:
        pytest.fail(f"the killed run checkpointed step {last}, at or past the resume target; kill sooner")
    assert [r["step"] for r in rows] == list(range(last + 1, REFERENCE_STEPS + 1))
    assert_same_losses([r["loss"] for r in rows], reference[last:], LOSS_RTOL)


def test_deepspeed_env_merged_not_clobbered(killed_then_resumed, cluster):
    work = killed_then_resumed["work"]
    text = (work / ".deepspeed_env").read_text()
    assert text.startswith(USER_ENV), "the user's lines must stay as they were"
    assert "GLOO_SOCKET_IFNAME=eth0\n" in text and "NCCL_SOCKET_IFNAME=eth0\n" in text
    assert "TORCH_EXTENSIONS_DIR=" in text and "PYTHONPATH=" in text and "HF_HOME=" in text
    _, first_output = killed_then_resumed["killed"]
    assert (
        "added GLOO_SOCKET_IFNAME=eth0" in first_output and f"master {cluster.master.address}" in first_output
    )
    assert "added" not in ok(killed_then_resumed["resumed"]).split("+ ")[0]  # nothing new the second time


def test_openmpi_launcher_across_hosts(cluster, args, reference, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (apt-get install -y openmpi-bin libopenmpi-dev)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")
    output = ok(
        launch(
            cluster.hostfile,
            args(tmp_path / "run"),
            tmp_path / "launch.log",
            tmp_path,
            "--launcher",
            "openmpi",
        )
    )
    assert "mpirun" in output
    assert_same_losses(losses(tmp_path / "run"), reference, LOSS_RTOL)


HOSTILE = [
    "--validation-prompts",
    "a $100 bill",
    "it's",
    "`id`",
    "a;b",
    'say "hi"',
    "\u00fcber \u00e9t\u00e9 \u2603",
    "",
    "$(touch /tmp/sdzero-pwned)",
    "back\\slash",
    "--max-steps",
    "3",
]
ECHO_RANK = """import json, os, sys
from pathlib import Path
from sdzero.cluster.launch_command import decode_argv
Path({out!r}, "argv." + os.environ["RANK"] + ".json").write_text(json.dumps(decode_argv(sys.argv[1:])))
"""


def test_every_option_reaches_each_remote_rank_byte_for_byte(cluster, tmp_path):
    """pdsh joins DeepSpeed's command into one line for each node's shell: a rank echoes what it got."""
    from sdzero.cluster.hostfile import plan_launch

    script = tmp_path / "echo_rank.py"
    script.write_text(ECHO_RANK.format(out=str(tmp_path)))
    plan = plan_launch(cluster.hostfile, HOSTILE, workdir=tmp_path, entry=script)
    assert plan.launch.run() == 0
    for rank in range(2):
        argv = json.loads((tmp_path / f"argv.{rank}.json").read_text())
        assert argv[1:] == HOSTILE and argv[0].startswith("--local_rank"), argv
    assert not os.path.exists("/tmp/sdzero-pwned")
