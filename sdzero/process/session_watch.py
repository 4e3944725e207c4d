"""A remote rank ends when the ssh session that started its node's launcher is gone.

pdsh (DeepSpeed's default multi-host runner) and mpirun start each node's launcher (DeepSpeed's
deepspeed.launcher.launch, Open MPI's orted) as an ssh command: `sshd` runs the node's shell line, and
the launcher under it. When the launching host loses the launch whole (an OOM kill of the command, its
LaunchGuard and pdsh together; the login node rebooted), the ssh connections close and each node's sshd
session exits, but sshd does not signal the command it ran: the launcher is handed to init and, with its
ranks, trains on. Only output written into the closed channel ends it, and a rank that is hung, stopped
or simply quiet writes none.

So every rank started through `sdzero.process.rank_entry` whose launcher is an ssh command leaves a small
watcher behind (a fork of the entry, before it becomes the rank): it looks at that sshd session process
and, once it is gone, SIGKILLs the launcher (its ranks follow by their parent-death signal,
sdzero.process.orphan_guard) and the rank. The watcher dies with its rank (PR_SET_PDEATHSIG), so a launch
that ends normally leaves nothing behind. A launch that is not an ssh command (one host, Slurm, a user's
own shell over ssh running `sdzero train`) gets no watcher: the launcher's parent there is not a shell
started by sshd.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

from sdzero.process.orphan_guard import is_launcher, process_argv, set_parent_death_signal

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "csh", "tcsh"})
POLL_S = 0.5
SSHD_PREFIX = "sshd"
"""An sshd session process's argv[0]: `sshd: USER@notty` (OpenSSH >= 9.8: `sshd-session: ...`)."""


def ssh_session_of(launcher: int) -> tuple[int, float] | None:
    """(pid, start time) of the sshd session process that started `launcher` through shells only (the
    remote command of pdsh or mpirun); None for a launcher started any other way."""
    try:
        proc = psutil.Process(launcher).parent()
        while proc is not None and proc.name() in SHELLS:
            proc = proc.parent()
        if proc is None:
            return None
        argv = proc.cmdline()
        if argv and argv[0].startswith(SSHD_PREFIX):
            return proc.pid, proc.create_time()
    except psutil.Error:
        return None
    return None


def session_alive(session: tuple[int, float]) -> bool:
    pid, started = session
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch_ssh_session() -> int | None:
    """In a rank's entry, before it becomes the rank (exec): fork the watcher if this rank's launcher is
    an ssh command. The watcher's pid, or None where none is needed. Returns in the entry only."""
    launcher = os.getppid()
    if not is_launcher(process_argv(launcher)):
        return None
    session = ssh_session_of(launcher)
    if session is None:
        return None
    rank = os.getpid()
    child = os.fork()
    if child:
        return child
    try:  # the watcher: never returns into the entry's code
        _watch(rank, launcher, session)
    finally:
        os._exit(0)


def _watch(rank: int, launcher: int, session: tuple[int, float]) -> None:
    set_parent_death_signal(signal.SIGKILL)  # the rank ended (any way): nothing left to watch
    if os.getppid() != rank:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # hold no end of the ssh channel open: its close is what ends the session
        os.dup2(devnull, fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a signal for the launch is for the rank, not us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == rank:
        if not session_alive(session):
            for pid in (launcher, rank):  # the launcher first: the rank's death ends this watcher
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(POLL_S)
