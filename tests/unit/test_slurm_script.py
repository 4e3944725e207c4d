"""`sdzero slurm`'s batch script, rendered and parsed (bash -n) without Slurm; the rank wrapper run alone;
the working folder's way into `#SBATCH --output`; the node list of an allocation (`sdzero doctor`). The
script under a real Slurm: tests/multinode/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.cluster.doctor import doctor_hosts
from sdzero.cluster.slurm import LOG_NAME, allocation_nodes, sbatch_file_pattern
from sdzero.errors import UserError

TRAIN = ["--deepspeed_config", "ds.json", "--model", "m", "--data", "d", "--output-dir", "runs/a"]


def render(*options: str, train: list[str] = TRAIN):
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
        f'#SBATCH --output="{Path.cwd()}/slurm-%x-%j.log"',
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


def test_odd_working_folder_is_quoted_for_sbatch_and_for_the_shell(tmp_path, monkeypatch):
    folder = tmp_path / "a b$x;y&z'q #1 %j"
    folder.mkdir()
    monkeypatch.chdir(folder)
    result = render("--nodes", "2", "--gpus-per-node", "1", train=[*TRAIN[:-1], str(folder / "o u t")])
    assert result.exit_code == 0, result.output
    escaped = str(folder).replace("%", "%%")  # sbatch's file-name pattern: %% is a literal %
    assert f'#SBATCH --output="{escaped}/slurm-%x-%j.log"\n' in result.output
    script = tmp_path / "job.sbatch"
    script.write_text(result.output)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    # The body's cd and OUT= are shell words: bash reads them back as the very paths.
    lines = [x for x in result.output.splitlines() if x.startswith(("cd ", "OUT="))]
    shown = subprocess.run(
        ["bash", "-c", "\n".join([*lines[:1], "pwd", lines[1].replace("cd ", ""), 'echo "$OUT"'])],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert shown.stdout.splitlines() == [str(folder), str(folder / "o u t")], shown.stderr


@pytest.mark.parametrize("char", ['"', "\\", "\n", "\t"])
def test_a_working_folder_sbatch_cannot_carry_is_refused_in_one_line(tmp_path, monkeypatch, char):
    folder = tmp_path / f"bad{char}name"
    folder.mkdir()
    monkeypatch.chdir(folder)
    result = render("--nodes", "2", "--gpus-per-node", "1")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "which an #SBATCH line cannot carry" in lines[0] and repr(char) in lines[0]


def test_sbatch_file_pattern_keeps_the_patterns_of_the_name():
    assert sbatch_file_pattern(Path("/a 100%/b"), LOG_NAME) == '"/a 100%%/b/slurm-%x-%j.log"'
    with pytest.raises(UserError, match="cannot carry"):
        sbatch_file_pattern(Path('/a"b'), LOG_NAME)


def script_wrapper() -> str:
    text = render("--nodes", "1", "--gpus-per-node", "1").output
    return text.split("<<'WRAPPER'\n", 1)[1].split("\nWRAPPER\n", 1)[0]


@pytest.mark.parametrize("master", ["localhost", "127.0.0.1"])
def test_rank_wrapper_finds_the_interface_from_a_node_name(master):
    """Slurm gives node names; `ip route get NAME` fails, and the interface came back empty."""
    env = {
        "PATH": os.environ["PATH"],
        "MASTER_ADDR": master,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
    }
    shown = subprocess.run(
        ["bash", "-c", script_wrapper(), "rank", "sh", "-c", "echo $GLOO_SOCKET_IFNAME"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "lo"  # the interface holding 127.0.0.1


def test_rank_wrapper_stops_on_a_master_name_that_does_not_resolve():
    env = {"PATH": os.environ["PATH"], "MASTER_ADDR": "no-such-node.invalid"}
    shown = subprocess.run(
        ["bash", "-c", script_wrapper(), "rank", "true"], capture_output=True, text=True, env=env, timeout=30
    )
    assert shown.returncode == 2 and "master node no-such-node.invalid does not resolve" in shown.stderr


def fake_scontrol(tmp_path: Path, body: str) -> dict[str, str]:
    """A PATH whose `scontrol` runs `body` (the real one is exercised under Slurm in tests/multinode)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_allocation_nodes_expand_the_node_list_with_scontrol(tmp_path, monkeypatch):
    env = fake_scontrol(tmp_path, '[ "$1 $2 $3" = "show hostnames gpu[01-02]" ] && printf "gpu01\\ngpu02\\n"')
    monkeypatch.setenv("PATH", env["PATH"])
    assert allocation_nodes({"SLURM_JOB_NODELIST": "gpu[01-02]"}) == ["gpu01", "gpu02"]
    assert allocation_nodes({}) is None  # outside an allocation


def test_allocation_nodes_say_why_when_scontrol_fails(tmp_path, monkeypatch):
    env = fake_scontrol(tmp_path, 'echo "scontrol: error: Invalid hostlist: $3" >&2; exit 1')
    monkeypatch.setenv("PATH", env["PATH"])
    with pytest.raises(UserError, match=r"Invalid hostlist: gpu\[01-; pass --hostfile"):
        allocation_nodes({"SLURM_JOB_NODELIST": "gpu[01-"})


def test_doctor_outside_an_allocation_checks_this_machine(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert doctor_hosts(None) == [None]


FAKE_SRUN = """#!/bin/bash
# The ranks, as the batch script sees them through srun: USR1 makes them save and exit 143.
trap 'kill "$pid"; exit 143' USR1
touch "$SRUN_STARTED"
[ -n "${SRUN_EXIT:-}" ] && exit "$SRUN_EXIT"
sleep 30 >/dev/null & pid=$!
wait
"""
FAKE_SCONTROL = """#!/bin/sh
case "$1" in
  show) echo node1 ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""


@pytest.mark.parametrize(
    ("signal_name", "srun_exit", "requeued", "exit_code"),
    [
        ("USR1", None, True, 0),  # Slurm's warning: save, requeue
        ("TERM", None, False, 143),  # scancel / a lost node: save, and Slurm decides (no self-requeue)
        (None, 143, True, 0),  # the ranks were signalled themselves (scancel --signal=USR1, steps only)
        (None, 1, False, 1),  # a failure is not a preemption
        (None, 142, True, 0),  # a stall named by the ranks (sdzero.process.stall_watch): restartable
    ],
)
def test_which_endings_requeue_the_job(tmp_path, monkeypatch, signal_name, srun_exit, requeued, exit_code):
    """The script's decision table with stand-ins for srun and scontrol (the real ones: the multinode
    tier runs USR1, scancel and a lost node under Slurm)."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "job.sbatch"
    script.write_text(render("--nodes", "1", "--gpus-per-node", "1", train=[*TRAIN[:-1], "out"]).output)
    started, log = tmp_path / "srun.started", tmp_path / "scontrol.log"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SRUN_STARTED": str(started),
        "SCONTROL_LOG": str(log),
        **({"SRUN_EXIT": str(srun_exit)} if srun_exit is not None else {}),
    }
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if signal_name is not None:
        time.sleep(0.2)  # srun's own trap is set before it marks itself started; the script's before srun
        proc.send_signal(getattr(signal, f"SIG{signal_name}"))
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == exit_code, output
    assert (log.read_text() if log.exists() else "") == ("requeue 7\n" if requeued else ""), output
