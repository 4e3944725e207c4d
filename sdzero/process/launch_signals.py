"""`sdzero train` and `sdzero launch` pass a stop signal on to the ranks, and exit with the ranks' code.

Between the command and the ranks stand DeepSpeed's runner and its per-node launcher
(deepspeed.launcher.launch). A SIGTERM to the command alone once reached neither: the ranks trained on to
the last step, and a scheduler that preempts a job step that way lost the save the trainer promises.
Handing it to the launcher is no better: its handler kills every rank's process tree, gives them 30 s,
and exits 1 whatever the ranks did, so a preemption that saved read as a failure.

So the launch runs in a session of its own (a terminal's Ctrl-C reaches this process only) and a signal
goes to the ranks themselves: SIGTERM and SIGUSR1 as they are, SIGINT and SIGHUP as SIGTERM (a
KeyboardInterrupt in a rank ends in a traceback with no checkpoint). Each rank saves at the next step
boundary and exits 143 (sdzero.process.preemption); the launcher sees that code and exits with it, and
so does this command. A second signal ends the whole launch at once (SIGKILL to its process group, and to
the remote ranks). Local ranks are found as the children of the per-node launcher below the runner;
remote ones (a pdsh launch over several hosts) are reached by `pkill` over pdsh, by the launch's id that
each rank carries on its command line (sdzero.process.rank_entry).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
PER_NODE_LAUNCHER = "deepspeed.launcher.launch"
STALL_POLL_S = 0.2
"""How often the waiting command looks at the launch (and for a stall.json): its exit is seen this late."""
RemoteSignal = Callable[[int], None]
"""Sends a signal to the launch's remote ranks (None: a launch whose ranks all run on this host)."""


def rank_signal(signum: int) -> int:
    """What the ranks get for `signum`: SIGUSR1 as is, everything else as SIGTERM (both: save and stop)."""
    return signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM


def local_ranks(root_pid: int) -> list[psutil.Process]:
    """The rank processes below `root_pid`: the children of each DeepSpeed per-node launcher there (the
    ranks' own children, DataLoader workers, ignore the signals anyway)."""
    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    ranks: list[psutil.Process] = []
    for proc in tree:
        try:
            if PER_NODE_LAUNCHER in proc.cmdline():
                ranks += proc.children()
        except psutil.Error:
            continue
    return ranks


class SignalForwarder:
    """The handler installed while a launch runs (see the module docstring)."""

    def __init__(self, launch: subprocess.Popen[bytes], remote: RemoteSignal | None = None) -> None:
        self.launch = launch
        self.remote = remote
        self.received: int | None = None

    def __call__(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"sdzero: {name} again: ending the launch now, without a save", file=sys.stderr, flush=True)
            self._kill_all()
            return
        self.received = signum
        sent = rank_signal(signum)
        ranks = local_ranks(self.launch.pid)
        for rank in ranks:
            with contextlib.suppress(psutil.Error):  # it may have ended meanwhile
                rank.send_signal(sent)
        if self.remote is not None:
            self.remote(sent)
        elif not ranks:  # no rank started yet: the launcher ends the start-up itself
            self._signal_group(signal.SIGTERM)
        print(
            f"sdzero: {name}: passed to the ranks as {signal.Signals(sent).name}; they save at the next step "
            "boundary and stop (send it again to stop at once, without a save)",
            file=sys.stderr,
            flush=True,
        )

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(OSError):  # the launch is the leader of its own session and group
            os.killpg(self.launch.pid, sig)

    def _kill_all(self) -> None:
        self._signal_group(signal.SIGKILL)
        if self.remote is not None:
            self.remote(signal.SIGKILL)


def wait_forwarding(
    launch: subprocess.Popen[bytes],
    remote: RemoteSignal | None = None,
    *,
    output_dir: Path | None = None,
) -> int:
    """Wait for `launch` (started with start_new_session=True), forwarding FORWARDED signals to its ranks;
    its exit code, 128 + N when a signal N ended it, EXIT_STALLED when its ranks named a stall in
    `output_dir` (sdzero.process.stall_exit)."""
    from sdzero.process.stall_exit import StallCheck

    forwarder = SignalForwarder(launch, remote)
    stall = StallCheck(output_dir)
    previous = {sig: signal.signal(sig, forwarder) for sig in FORWARDED}
    try:
        while (code := launch.poll()) is None:
            if stall.named() and stall.overdue():
                forwarder._kill_all()  # a rank that cannot exit by itself (stopped, stuck in I/O)
            time.sleep(STALL_POLL_S)
    except BaseException:
        forwarder._kill_all()  # this process is going: take the launch with it
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stall.named():
        return stall.report()
    return code if code >= 0 else 128 - code


def run_forwarding(
    command: Sequence[str],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    remote: RemoteSignal | None = None,
    output_dir: Path | None = None,
) -> int:
    """Run a launch command in its own session (guarded: it ends if this process dies, see
    sdzero.process.orphan_guard) and wait for it with the signals forwarded."""
    from sdzero.process.orphan_guard import popen_guarded

    launch = popen_guarded(list(command), cwd=cwd, env=None if env is None else dict(env))
    return wait_forwarding(launch, remote, output_dir=output_dir)


def pdsh_signal_command(hosts: Sequence[str], launch_id: str, sig: int) -> list[str]:
    """`pkill` of the launch's ranks on every host: each rank's command line holds `-X sdzero_launch=ID`
    (the bracket keeps the pattern from matching the remote shell that runs pkill itself)."""
    pattern = f"sdzero_launc[h]={launch_id}"
    return ["pdsh", "-f", "1024", "-w", ",".join(hosts), f"pkill -{int(sig)} -f '{pattern}' || true"]


def pdsh_remote_signal(hosts: Sequence[str], launch_id: str, env: Mapping[str, str]) -> RemoteSignal:
    def send(sig: int) -> None:
        env_ = {**env, "PDSH_RCMD_TYPE": "ssh"}
        try:
            subprocess.run(
                pdsh_signal_command(hosts, launch_id, sig),
                env=env_,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            print("sdzero: could not reach the remote ranks over pdsh to pass the signal", file=sys.stderr)

    return send
