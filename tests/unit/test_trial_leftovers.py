"""A timed-out trial leaves no checkpoint: its ranks answer the kill's SIGTERM with a preemption save,
which is no result of the trial, only disk used (a full optimizer state per trial)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from advisor.measure import trials
from sdzero.cluster.remote_launch import local_launch

SAVES_ON_SIGTERM = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    def save(signum, frame):  # what a rank does on SIGTERM: save the step, then exit 143
        step = Path(sys.argv[1], "run", "checkpoints", "step_00000001")
        step.mkdir(parents=True)
        (step / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
        sys.exit(143)
    signal.signal(signal.SIGTERM, save)
    print("started", flush=True)
    time.sleep(60)
""")


def test_a_timed_out_trial_leaves_no_checkpoint(tmp_path, monkeypatch):
    trial_dir = tmp_path / "trial"
    trial_dir.mkdir()
    command = [sys.executable, "-c", SAVES_ON_SIGTERM, str(trial_dir)]
    monkeypatch.setattr(trials, "trial_launch", lambda *a: local_launch(command, a[-1]))
    monkeypatch.setattr(trials, "POLL_S", 0.05)
    settings = trials.TrialSettings(
        model="m", data=Path("d"), steps=1, warmup_steps=0, trial_timeout_s=1.5, stall_timeout_s=None
    )
    outcome = trials.run_trial(None, settings, tmp_path / "ds.json", trial_dir)
    assert "timeout" in outcome.reason and outcome.returncode == 143  # it did save, then was discarded
    assert not (trial_dir / "run" / "checkpoints").exists()
    assert (trial_dir / "log.txt").is_file()  # the log stays: it says why the trial ended
