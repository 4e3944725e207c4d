"""One live run per output folder: a second run is refused naming the holder; a dead holder's lock
(SIGKILL leaves the file behind) is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from sdzero.checkpoint.output_lock import LOCK_NAME, claim_output_dir, release_output_dir
from sdzero.errors import UserError

HOLD = "import sys, time; from sdzero.checkpoint.output_lock import claim_output_dir; claim_output_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)"


def holder(out) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_holds_the_folder_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    proc = holder(out)
    try:
        with pytest.raises(UserError) as err:
            claim_output_dir(out)
        message = str(err.value)
        assert f"host {socket.gethostname()}, pid {proc.pid}" in message and "in use by a live run" in message
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no clean-up runs: the file stays, the kernel drops the lock
        proc.wait()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid
    claim_output_dir(out)
    try:
        assert json.loads((out / LOCK_NAME).read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    finally:
        release_output_dir(out)


def test_an_unwritable_output_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError, match="cannot write there"):
        claim_output_dir(blocker / "run")
