"""`sdzero slurm`: the batch script is rendered and parsed (bash -n) here, and run for real against the
namespace cluster with stand-in `scontrol`/`srun` (tests/cluster/slurm_shims): Slurm's warning signal makes
every rank checkpoint and the job requeue itself; the requeued start resumes and finishes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from cluster.launching import finish, start, wait_for_step
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.checkpoint import checkpointer as ck
from sdzero.telemetry.metrics import read_metrics

SHIMS = Path(__file__).resolve().parents[1] / "cluster" / "slurm_shims"
STEPS = 12
TRAIN = ["--deepspeed_config", "ds.json", "--model", "m", "--data", "d", "--output-dir", "runs/a"]


def render(*options: str, train: list[str] = TRAIN) -> subprocess.CompletedProcess | object:
    return CliRunner().invoke(app, ["slurm", *options, "--", *train])


def test_script_renders_and_parses(tmp_path):
    result = render("--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--time", "2-00:00:00")
    assert result.exit_code == 0, result.output
    script = tmp_path / "job.sbatch"
    script.write_text(result.output)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = result.output
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
    ):
        assert line in text
    assert (
        'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    )
    assert "--output-dir runs/a --resume auto &" in text


def test_users_resume_choice_is_kept_and_cpu_jobs_ask_no_gpus():
    result = render("--nodes", "1", "--gpus-per-node", "2", "--no-gpus", train=[*TRAIN, "--resume", "none"])
    assert result.exit_code == 0 and "--gpus-per-node" not in result.output.split("srun")[0]
    assert "--resume none &" in result.output and "--resume auto &" not in result.output


@pytest.mark.parametrize(
    ("options", "train", "expected"),
    [
        (("--nodes", "2", "--gpus-per-node", "8"), ["--max-steps", "3"], "pass the trainer's --output-dir"),
        (("--nodes", "0", "--gpus-per-node", "8"), TRAIN, "--nodes 0: must be at least 1"),
        (("--nodes", "2", "--gpus-per-node", "8", "--time", "1 day"), TRAIN, "use Slurm's format"),
        (("--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu;rm"), TRAIN, "--partition 'gpu;rm'"),
        (("--nodes", "2", "--gpus-per-node", "8", "--signal-lead-s", "1"), TRAIN, "between 10 and 3600"),
    ],
)
def test_bad_options_exit_2(options, train, expected):
    result = render(*options, train=train)
    assert result.exit_code == 2 and expected in result.output


@pytest.mark.multinode
def test_preempted_job_checkpoints_requeues_and_resumes(cluster, args, tmp_path):
    # absolute paths; the script adds --resume auto. 12 steps: the warning comes after step 2, and the
    # ranks save at the next step boundary, far before the end; the requeued job trains the rest.
    config_args = args(tmp_path / "run", STEPS)
    rendered = render(
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--no-gpus",
        "--master-port",
        "29741",
        "--signal-lead-s",
        "60",
        train=config_args,
    )
    assert rendered.exit_code == 0, rendered.output
    script = tmp_path / "job.sbatch"
    script.write_text(rendered.output)
    # Node names, as Slurm gives them: the ranks resolve the master's name on their hosts (/etc/hosts of
    # each host's mount namespace); the srun stand-in reaches each node through the same table.
    nodes = ",".join(h.hostname for h in cluster.members)
    env = {
        "PATH": f"{SHIMS}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": nodes,
        "SHIM_LOG": str(tmp_path / "shim.log"),
        "SHIM_HOSTS_FILE": str(cluster.state_dir / "hosts"),
    }
    out = tmp_path / "run"

    first = start(["bash", str(script)], tmp_path / "first.log", tmp_path, env)
    try:
        wait_for_step(out, 2, first)
        os.kill(first.pid, signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@60` does: the batch shell only
    except BaseException:
        os.killpg(first.pid, signal.SIGKILL)
        raise
    code, output = finish(first, timeout=240)
    assert code == 0, output[-4000:]
    assert (tmp_path / "shim.log").read_text() == "requeue 4242\n", output[-3000:]
    assert "got SIGUSR1" in output and "after a preemption warning; requeueing job 4242" in output
    assert "preempted: checkpoint of step" in output  # the ranks saved before stopping
    saved = [m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out))]
    assert len(saved) == 1 and 2 <= saved[0] < STEPS
    assert (out / "hostfile.4242").read_text() == "".join(f"{h.hostname} slots=1\n" for h in cluster.members)
    assert f"master {cluster.members[0].hostname}:29741" in output

    second = start(
        ["bash", str(script)], tmp_path / "second.log", tmp_path, {**env, "SLURM_RESTART_COUNT": "1"}
    )
    code, output = finish(second, timeout=300)
    assert code == 0, output[-4000:]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(saved[0] + 1, STEPS + 1))
    assert (tmp_path / "shim.log").read_text() == "requeue 4242\n"  # no second requeue


@pytest.mark.parametrize("master", ["localhost", "127.0.0.1"])
def test_rank_wrapper_finds_the_interface_from_a_node_name(tmp_path, master):
    """Slurm gives node names; `ip route get NAME` fails, and the interface came back empty."""
    text = render("--nodes", "1", "--gpus-per-node", "1").output
    wrapper = text.split("<<'WRAPPER'\n", 1)[1].split("\nWRAPPER\n", 1)[0]
    env = {
        "PATH": os.environ["PATH"],
        "MASTER_ADDR": master,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
    }
    shown = subprocess.run(
        ["bash", "-c", wrapper, "rank", "sh", "-c", "echo $GLOO_SOCKET_IFNAME"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "lo"  # the interface holding 127.0.0.1


def test_rank_wrapper_stops_on_a_master_name_that_does_not_resolve():
    text = render("--nodes", "1", "--gpus-per-node", "1").output
    wrapper = text.split("<<'WRAPPER'\n", 1)[1].split("\nWRAPPER\n", 1)[0]
    env = {"PATH": os.environ["PATH"], "MASTER_ADDR": "no-such-node.invalid"}
    shown = subprocess.run(
        ["bash", "-c", wrapper, "rank", "true"], capture_output=True, text=True, env=env, timeout=30
    )
    assert shown.returncode == 2 and "master node no-such-node.invalid does not resolve" in shown.stderr
