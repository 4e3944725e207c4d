"""Signals through `sdzero launch` (issue #44), with DeepSpeed's real per-node launcher and two small rank
processes that behave as the trainer's ranks do on a preemption (save, exit 143): the command exits 143,
not the launcher's 1, and a rank's command line carries the launch id that a remote `pkill` finds.
The 2-rank trainer run through `sdzero train` is tests/dist/test_launch_signals.py."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from sdzero.cluster.launch_command import REPO_ROOT
from sdzero.process import launch_signals
from sdzero.process.rank_entry import Payload, decode_payload, encode_payload, rank_argv

RANK = """
import os, signal, sys, time
folder = sys.argv[-1]
rank = os.environ["RANK"]
def save(signum, frame):
    time.sleep(0.5)  # a save takes a while; the launcher must not cut it short
    open(os.path.join(folder, f"saved{rank}-{signum}"), "w").close()
    os._exit(143)
signal.signal(signal.SIGTERM, save)
signal.signal(signal.SIGUSR1, save)
open(os.path.join(folder, f"ready{rank}"), "w").close()
while True:
    time.sleep(0.1)
"""

LAUNCHER = """
import sys
from pathlib import Path
from sdzero.cluster.remote_launch import local_launch
sys.exit(local_launch(sys.argv[1:]).run())
"""


def start(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    per_node = [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={world}",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        "--master_port=29731",
        "--no_local_rank",
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *per_node],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def wait_ready(tmp_path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)


def run_with_signal(tmp_path: Path, sig: int) -> tuple[int, str]:
    proc = start(tmp_path)
    tree: list[psutil.Process] = []
    try:
        wait_ready(tmp_path, proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, sig)  # the command alone, as `kill` or a scheduler's job step sends it
        code = proc.wait(timeout=60)
    finally:
        # The whole session, whether or not the command itself is still there: ranks the fix failed to
        # reach (or a command that died of the signal) would otherwise be left running.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for leftover in tree:  # the launch runs in a session of its own
            with contextlib.suppress(psutil.Error):
                leftover.kill()
        proc.wait()
    return code, proc.stderr.read().decode()


def test_sigterm_to_the_launch_reaches_the_ranks_and_exits_with_their_143(tmp_path):
    code, err = run_with_signal(tmp_path, signal.SIGTERM)
    assert code == 143, err[-2000:]  # before: 1, DeepSpeed's launcher's own code after killing the ranks
    assert sorted(p.name for p in tmp_path.glob("saved*")) == [
        f"saved0-{int(signal.SIGTERM)}",
        f"saved1-{int(signal.SIGTERM)}",
    ]
    assert "passed to the ranks as SIGTERM" in err


def test_sigusr1_reaches_the_ranks_as_sigusr1(tmp_path):
    code, _ = run_with_signal(tmp_path, signal.SIGUSR1)
    assert code == 143
    assert sorted(p.name for p in tmp_path.glob("saved*")) == [
        f"saved0-{int(signal.SIGUSR1)}",
        f"saved1-{int(signal.SIGUSR1)}",
    ]


def test_sigint_asks_the_ranks_for_the_same_save(tmp_path):
    code, _ = run_with_signal(tmp_path, signal.SIGINT)
    assert code == 143 and len(list(tmp_path.glob(f"saved*-{int(signal.SIGTERM)}"))) == 2


def test_a_rank_carries_the_launch_id_and_pkills_pattern_finds_it_but_not_itself():
    payload = Payload("/w", ["train.py", "--x"], {}, None, "0a1b2c")
    assert decode_payload(encode_payload(payload)).launch_id == "0a1b2c"
    argv = rank_argv(payload, ["--local_rank=0"], "/py")
    assert argv[:4] == ["/py", "-u", "-X", "sdzero_launch=0a1b2c"] and argv[4:] == [
        "train.py",
        "--local_rank=0",
        "--x",
    ]
    command = launch_signals.pdsh_signal_command(["n1", "n2"], "0a1b2c", signal.SIGTERM)
    assert command[:5] == ["pdsh", "-f", "1024", "-w", "n1,n2"]
    import re

    pattern = re.search(r"-f '([^']+)'", command[-1]).group(1)
    assert re.search(pattern, " ".join(argv)) and not re.search(pattern, command[-1])


def test_a_payload_with_a_launch_id_that_is_not_hex_is_refused():
    import pytest

    from sdzero.errors import UserError

    word = base64.b64encode(
        json.dumps(
            {"cwd": "/", "command": ["t.py"], "env": {}, "secrets_file": None, "launch_id": "x; rm"}
        ).encode()
    ).decode()
    with pytest.raises(UserError):
        decode_payload(word)
