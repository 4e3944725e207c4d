"""sdzero.process.children without ranks: `sdzero comm`'s launcher code under the wrapper the CLI puts around
advise/profile/comm, with a stand-in launcher whose child runs in the launcher's own session (as ranks
do). On SIGINT, SIGTERM and SIGHUP nothing may be left 15 s later. Before the wrapper, SIGTERM and SIGHUP
ended the command at once and left the whole session running."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

COMMAND = textwrap.dedent("""
    import sys
    from pathlib import Path
    from advisor.measure.collectives_launch import launch
    from sdzero.process.children import ending_children_on_signals
    launcher = [sys.executable, "-c",
                "import subprocess, time; subprocess.Popen(['sleep', '300']); print('ready', flush=True); time.sleep(300)"]
    ending_children_on_signals(launch)(launcher, Path(sys.argv[1]), 300)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_command_ends_the_launchers_session(sig, tmp_path):
    log = tmp_path / "launch.log"
    proc = subprocess.Popen([sys.executable, "-c", COMMAND, str(log)])
    try:
        deadline = time.monotonic() + 60
        while "\nready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        # the command, the launcher (its own session), the launcher's child, and the launch's guard
        # (sdzero.process.orphan_guard), which leaves once the launch's session is empty
        assert len(tree) == 4 and sum("orphan_guard" in " ".join(p.cmdline()) for p in tree) == 1
        proc.send_signal(sig)
        gone, alive = psutil.wait_procs(tree, timeout=15)  # reaps the command: its code is read here
        assert alive == [], [p.cmdline() for p in alive]
        assert {p.pid: p.returncode for p in gone}[proc.pid] == 128 + sig
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()
