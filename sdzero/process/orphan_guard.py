"""No orphans: a launch ends when the process that started it dies, however it dies.

`sdzero train`, `sdzero launch` and the advisor's trials start their launcher in a session of its own
(so that a hung launch can be killed whole, and a terminal's Ctrl-C reaches the command only). A SIGKILL
or an OOM kill of the command runs no `finally`: its launcher and ranks used to train on to --max-steps.

Two guards, so that every launch path is covered:

- `LaunchGuard`: a small process (`python -m sdzero.process.orphan_guard`, no torch import) in a session
  of its own that watches the command's pid. When the command is gone it SIGKILLs the launch's process
  group (the runner, pdsh or mpirun, the per-node launcher and the local ranks with their loader workers)
  and runs the launch's remote kill, if any (pdsh `pkill` by the launch's id on every host, as
  sdzero.process.launch_signals does for a second Ctrl-C). mpirun's remote daemons end their ranks when
  mpirun goes; Slurm ends a step whose srun is gone.
- `die_with_launcher()`, in every rank: a rank whose parent is a launcher (DeepSpeed's per-node launcher,
  Open MPI's orted/prted, slurmstepd) asks the kernel for SIGKILL when that parent dies
  (PR_SET_PDEATHSIG), so a rank never outlives its own node's launcher either.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

PR_SET_PDEATHSIG = 1
POLL_S = 0.2
LAUNCHER_PROGRAMS = ("orted", "prted", "slurmstepd")
"""Parents whose death must end a rank: Open MPI's and Slurm's per-node daemons (by program name), and
DeepSpeed's per-node launcher (PER_NODE_MODULE anywhere on its command line)."""
PER_NODE_MODULE = "deepspeed.launcher.launch"


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Linux: the kernel sends `sig` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def process_argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def is_launcher(argv: list[str]) -> bool:
    # slurmstepd rewrites its argv to "slurmstepd: [JOB.STEP]"
    program = os.path.basename(argv[0]).split(":")[0] if argv else ""
    return program in LAUNCHER_PROGRAMS or PER_NODE_MODULE in argv


def die_with_launcher() -> bool:
    """In a rank: SIGKILL when the launcher that started it dies. Only under a launcher: a rank a user
    started by hand (`python sdzero/train.py` under nohup) must not die with its shell. True if set."""
    parent = os.getppid()
    if not is_launcher(process_argv(parent)):
        return False
    if not set_parent_death_signal(signal.SIGKILL):
        return False
    if os.getppid() != parent:  # the launcher died before the request: the kernel will not signal now
        os._exit(128 + signal.SIGKILL)
    return True


class LaunchGuard:
    """The guard of one launch (see the module docstring): `start()` right after the launch, `stop()` once
    it ended normally (the guard then kills nothing)."""

    def __init__(self, launch_pid: int, remote_kill: Sequence[str] | None = None, env: dict | None = None):
        self.launch_pid = launch_pid
        self.remote_kill = list(remote_kill) if remote_kill else None
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> LaunchGuard:
        argv = [sys.executable, "-m", "sdzero.process.orphan_guard", str(os.getpid()), str(self.launch_pid)]
        if self.remote_kill:
            argv.append(json.dumps(self.remote_kill))
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to this command's process group must not end its guard
            env=self.env,
        )
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        self.process = None


def popen_guarded(
    command: Sequence[str], remote_kill: Sequence[str] | None = None, **kwargs: object
) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(command, start_new_session=True, **kwargs)` with a LaunchGuard beside it. The
    guard leaves by itself once the launch's process group is empty (the launch ended, or was killed)."""
    launch: subprocess.Popen[bytes] = subprocess.Popen(list(command), start_new_session=True, **kwargs)  # type: ignore[call-overload]
    try:
        LaunchGuard(launch.pid, remote_kill).start()
    except OSError:
        launch.kill()
        raise
    return launch


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def guard(watched: int, group: int, remote_kill: list[str] | None) -> int:
    """Wait until `watched` is gone (then end the launch: 1) or the launch's group is empty (0). A SIGTERM
    (the command's own `stop()`) ends the guard without killing anything."""
    while True:
        if not _group_exists(group):  # the launch is over (pdsh, with its remote shells, was in it)
            return 0
        if os.getppid() != watched or not psutil.pid_exists(watched):
            break
        time.sleep(POLL_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)
    if remote_kill:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                remote_kill,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=60,
                check=False,
                env={**os.environ, "PDSH_RCMD_TYPE": "ssh"},
            )
    print(
        f"sdzero: the process that started launch {group} is gone; its launcher and ranks were ended",
        file=sys.stderr,
        flush=True,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    watched, group = int(args[0]), int(args[1])
    remote = json.loads(args[2]) if len(args) > 2 else None
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return guard(watched, group, remote)


if __name__ == "__main__":
    sys.exit(main())
