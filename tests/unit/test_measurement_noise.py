"""Noise in the measurements: a trial's interval, the contention check, whole-row reading of trials.csv, and
the launches that measure configs side by side (advisor.measure.launch, with a stand-in launch on a
simulated machine whose speed changes between launches)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from advisor.measure import contention
from advisor.measure.contention import CpuSample, is_contended, others_cpu_share, session_cpu_s
from advisor.measure.csv_tables import read_whole_rows
from advisor.measure.grid import TrialSpec
from advisor.measure.launch import LaunchRunner, read_launches, repeat_halves
from advisor.measure.trial_table import TRIAL_COLUMNS, append_row, read_trials
from advisor.measure.trials import TrialOutcome, TrialSettings, trainer_args
from advisor.model.uncertainty import run_noise_floor
from sdzero.constants import GIB
from sdzero.telemetry.step_interval import interval_is_tight, median_interval

# --------------------------------------------------------------------------------------------------
# The interval of one trial's median step


def test_the_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(300):  # trials of 10 steps, scattered 10% around a median step of 1 s
        interval = median_interval(np.exp(rng.normal(0.0, 0.1, 10)))
        hits += interval.lo_s <= 1.0 <= interval.hi_s
    assert 0.90 <= hits / 300 <= 0.99


def test_more_steps_give_a_tighter_interval_and_one_slow_step_does_not_move_it():
    rng = np.random.default_rng(2)
    steps = np.exp(rng.normal(0.0, 0.1, 40))
    few, many = median_interval(steps[:8]), median_interval(steps)
    assert many.rel_halfwidth < few.rel_halfwidth
    calm = [0.100, 0.101, 0.099, 0.100, 0.102, 0.100, 0.098, 0.100, 0.101]
    slowed = median_interval([*calm, 0.9])  # one step while another process ran
    assert slowed.median_s == pytest.approx(0.100, abs=1e-3) and slowed.hi_s < 0.103
    assert interval_is_tight(slowed, 0.03) and not interval_is_tight(median_interval(steps[:8]), 0.03)


def test_one_step_has_no_interval_and_the_same_steps_give_the_same_interval():
    single = median_interval([0.5])
    assert single.median_s == 0.5 and math.isnan(single.lo_s) and single.rel_halfwidth == math.inf
    steps = [0.31, 0.35, 0.29, 0.42, 0.33, 0.30]
    assert median_interval(steps) == median_interval(list(steps))
    assert median_interval([]).steps == 0


# --------------------------------------------------------------------------------------------------
# Contention


def test_cpu_that_was_neither_the_trials_nor_ours_is_someone_elses():
    first = CpuSample(at=0.0, machine_busy_s=100.0, trial_s=10.0, own_s=1.0)
    alone = CpuSample(at=2.0, machine_busy_s=103.9, trial_s=13.8, own_s=1.05)
    beside = CpuSample(at=2.0, machine_busy_s=105.0, trial_s=13.0, own_s=1.05)
    assert others_cpu_share(first, alone, cores=2) == pytest.approx(0.05 / 4, abs=1e-9)
    assert not is_contended(others_cpu_share(first, alone, cores=2))
    # a one-rank training beside a 2-rank trial on 2 cores: it took about one core of the two
    assert others_cpu_share(first, beside, cores=2) == pytest.approx(1.95 / 4)
    assert is_contended(others_cpu_share(first, beside, cores=2))
    assert others_cpu_share(first, first) is None


def test_proc_stat_and_a_sessions_processes_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(contention, "_ticks", lambda: 100.0)
    (tmp_path / "stat").write_text("cpu  100 5 50 9000 20 3 2 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert contention.machine_busy_s(tmp_path) == pytest.approx((100 + 5 + 50 + 3 + 2 + 40) / 100)
    for pid, session, comm in ((11, 11, "deepspeed"), (12, 11, "python (rank 0)"), (13, 99, "other")):
        (tmp_path / str(pid)).mkdir()
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        fields = [
            "S",
            "1",
            str(pid),
            str(session),
            "0",
            "0",
            "0",
            "0",
            "0",
            "0",
            "0",
            "200",
            "100",
            "30",
            "20",
        ]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + " 0 0\n")
    assert session_cpu_s(11, tmp_path) == pytest.approx(2 * 350 / 100)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux /proc")
def test_a_real_processs_cpu_time_counts_as_its_sessions():
    burn = (
        "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.3: pass\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while session_cpu_s(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_cpu_s(child.pid) >= 0.3
        assert session_cpu_s(os.getsid(0)) < session_cpu_s(os.getsid(0)) + 1  # ours is readable too
    finally:
        child.kill()
        child.wait()


# --------------------------------------------------------------------------------------------------
# trials.csv survives a torn last row


def row(trial_id: str, **extra) -> dict:
    return {"trial_id": trial_id, "setup_id": "s", "status": "ok", "zero_stage": 1, **extra}


def test_a_row_cut_short_by_a_killed_writer_is_left_out(tmp_path):
    path = tmp_path / "trials.csv"
    append_row(path, row("a"))
    append_row(path, row("b", log_tail="line one\nline two"))
    whole = path.read_text()
    for torn in ("c,s,ok,,1,bf1", 'c,s,crash,"Traceback\n  File x\n', 'c,s,crash,"Trace'):
        path.write_text(whole + torn)
        table = read_trials(path)
        assert list(table["trial_id"]) == ["a", "b"] and table.attrs["torn_rows"] == 1
        assert table.loc[1, "log_tail"] == "line one\nline two"
    append_row(path, row("c"))  # the next write leaves a whole table again
    assert list(read_trials(path)["trial_id"]) == ["a", "b", "c"] and path.read_text().endswith("\n")
    assert read_whole_rows(path).attrs["torn_rows"] == 0


def test_a_header_cut_short_reads_as_no_trials(tmp_path):
    path = tmp_path / "trials.csv"
    path.write_text("trial_id,setu")
    assert read_trials(path).empty and tuple(read_trials(path).columns) == TRIAL_COLUMNS


# --------------------------------------------------------------------------------------------------
# Launches on a simulated machine


SETTINGS = TrialSettings(
    model="/m", data=Path("/d"), steps=5, warmup_steps=1, trial_timeout_s=60, stall_timeout_s=None
)
BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "train_micro_batch_size_per_gpu": 1}


def fake_profile(steps: list[float], micro_batch: int, accum: int = 1, peak: int = 1) -> dict:
    rank = {
        "rank": 0,
        "device_peak_bytes": peak,
        "model_state_bytes": {k: 1 for k in ("params", "grads", "master", "optimizer")},
        "model_state_total_bytes": 4,
        "bucket_bytes": 0,
        "offloaded_bytes": 0,
        "frozen_bytes": 0,
        "activation_bytes": 1,
        "cuda_peak_bytes": None,
        "comm_s": 0.0,
    }
    mean = sum(steps) / len(steps)
    batch = micro_batch * accum * 2
    return {
        "micro_batch": micro_batch,
        "grad_accum": accum,
        "world_size": 2,
        "global_batch": batch,
        "samples_per_s": batch / mean,
        "step_time_s": mean,
        "step_time_median_s": float(np.median(steps)),
        "ranks": [rank, {**rank, "rank": 1}],
        "trained_params": 1,
        "device_peak_bytes": peak,
        "peak_rss_bytes": 1,
        "measured_steps": len(steps),
        "step_times_s": steps,
        "stopped_by": "launch",
    }


class Machine:
    """A stand-in launch: each config's step is its true time x the machine's slowness during the launch
    (the n-th launch's `slowness[n]`), the same for every config of the launch and for its tie; a launch
    can be contended, or die (out of memory) at a micro-batch. It writes what the config sweep writes."""

    def __init__(self, slowness: list[float], contended: int = 0, dies_at: int | None = None) -> None:
        self.slowness, self.contended, self.dies_at = slowness, contended, dies_at
        self.calls: list[str] = []

    def __call__(self, spec: TrialSpec, settings, config: Path, folder: Path, env=None) -> TrialOutcome:
        slow = self.slowness[min(len(self.calls), len(self.slowness) - 1)]
        self.calls.append(settings.sweep)
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "log.txt"
        configs, medians = {}, {}
        for part in settings.sweep.split(","):
            mb, ga = (int(x) for x in part.split(":"))
            if self.dies_at is not None and mb >= self.dies_at:
                log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
                partial = {"launch": {"rounds": 3, "round_steps": 2}, "configs": configs}
                (folder / "profile.partial.json").write_text(json.dumps(partial))
                return TrialOutcome("crash", "a rank failed", None, 30.0, 1, log)
            true = 0.1 * mb * ga * (1 + 0.2 * spec.zero_stage)
            steps = [true * slow * (1 + 0.01 * ((i % 3) - 1)) for i in range(8)]
            configs[f"mb{mb}-ga{ga}"] = fake_profile(steps, mb, ga, peak=mb * GIB)
            medians[f"mb{mb}-ga{ga}"] = [true * slow * (1 + 0.02 * (i % 2)) for i in range(4)]
        log.write_text("ok\n")
        share = 0.0
        if self.contended > 0:
            self.contended -= 1
            share = 0.45
        launch = {
            "rounds": 5,
            "round_steps": 2,
            "seconds": {"warmup": 1.0, "instrumented": 0.5, "timed": 20.0, "tie": 0.1},
            "tie_s": [0.01 * slow] * 5,
            "oom": {},
            "round_medians_s": medians,
        }
        return TrialOutcome(
            "ok", "", {"launch": launch, "configs": configs}, 30.0, 0, log, others_cpu_share=share
        )


def make_runner(tmp_path: Path, machine: Machine, deadline: float | None = None, **settings) -> LaunchRunner:
    return LaunchRunner(
        replace(SETTINGS, **settings),
        BASE,
        tmp_path / "profile",
        "setup",
        say=lambda line: None,
        deadline=deadline,
        run_trial=machine,
    )


@pytest.fixture
def no_config_check(monkeypatch):
    monkeypatch.setattr("advisor.measure.launch.write_trial_config", lambda base, spec, d, w: d / "ds.json")


def group(stage: int, *micro_batches: int) -> list[TrialSpec]:
    return [TrialSpec(stage, "bf16", mb, "none", 2) for mb in micro_batches]


def test_one_launch_per_group_measures_all_its_configs_and_keeps_a_row_each(tmp_path, no_config_check):
    machine = Machine([1.0])
    table = make_runner(tmp_path, machine)([*group(1, 1, 2, 4), *group(2, 1, 2)], measure_s=20)
    assert machine.calls == ["1:1,2:1,4:1", "1:1,2:1"]  # two launches, not five trials
    assert len(table) == 5 and set(table["status"]) == {"ok"}
    # each row is its config's own measurement, in its launch's folder
    row = table.set_index("trial_id").loc["z1-bf16-mb4-off-none-r2"]
    assert row["step_time_median_s"] == pytest.approx(0.48, rel=0.02)
    assert str(row["trial_dir"]).endswith("trials/z1-bf16-off-none-r2/launch-0")
    # a row's wall time is a run of the config alone: the launch's start-up and the config's own steps
    assert row["wall_s"] == pytest.approx((30.0 - 21.6) + 9 * row["step_time_median_s"], rel=0.01)
    launches = read_launches(tmp_path / "profile" / "launches.json", "setup")
    assert [r.name for r in launches] == ["z1-bf16-off-none-r2", "z2-bf16-off-none-r2"]
    assert launches[0].startup_s == pytest.approx(8.4) and launches[0].timed_s == 20.0


def test_the_tie_puts_every_launch_on_the_first_launchs_machine_speed(tmp_path, no_config_check):
    """The second launch ran on a machine 1.3x as slow (its tie says so): its configs' steps are divided by
    it, and the raw medians kept."""
    table = make_runner(tmp_path, Machine([1.0, 1.3]))([*group(1, 1, 2), *group(2, 1, 2)])
    rows = table.set_index("trial_id")
    z2 = rows.loc["z2-bf16-mb2-off-none-r2"]
    assert z2["drift_factor"] == pytest.approx(1.3)
    assert z2["step_s_raw"] == pytest.approx(0.28 * 1.3, rel=0.02)
    assert z2["step_time_median_s"] == pytest.approx(0.28, rel=0.02)
    assert z2["step_s_lo"] < z2["step_time_median_s"] < z2["step_s_hi"]
    assert rows.loc["z1-bf16-mb2-off-none-r2", "drift_factor"] == pytest.approx(1.0)


def test_a_launch_that_dies_keeps_what_it_finished_and_launches_the_rest_without_the_culprit(
    tmp_path, no_config_check
):
    machine = Machine([1.0], dies_at=4)
    table = make_runner(tmp_path, machine)(group(1, 1, 2, 4, 8))
    statuses = dict(zip(table["trial_id"], table["status"], strict=True))
    assert statuses["z1-bf16-mb1-off-none-r2"] == statuses["z1-bf16-mb2-off-none-r2"] == "ok"
    assert statuses["z1-bf16-mb4-off-none-r2"] == "oom"  # the log said so
    # mb8 was launched again without mb4 (and dies there too on this machine): never silently dropped
    assert machine.calls[:2] == ["1:1,2:1,4:1,8:1", "8:1"]
    assert statuses["z1-bf16-mb8-off-none-r2"] == "oom"


def test_the_memory_cap_is_judged_per_config_on_its_own_peak(tmp_path, no_config_check):
    table = make_runner(tmp_path, Machine([1.0]), mem_cap_bytes=3 * GIB)(group(1, 1, 2, 4))
    statuses = dict(zip(table["trial_id"], table["status"], strict=True))
    assert statuses == {
        "z1-bf16-mb1-off-none-r2": "ok",
        "z1-bf16-mb2-off-none-r2": "ok",
        "z1-bf16-mb4-off-none-r2": "oom",
    }
    assert "--mem-cap-gib 3" in table.set_index("trial_id").loc["z1-bf16-mb4-off-none-r2", "reason"]


def test_a_contended_launch_is_launched_again_once_when_the_budget_has_room(tmp_path, no_config_check):
    machine = Machine([1.0], contended=1)
    runner = make_runner(tmp_path, machine, deadline=time.monotonic() + 3600)
    table = runner(group(1, 1, 2))
    assert len(machine.calls) == 2 and not table["contended"].map(bool).any()
    assert runner.answer_lines() == []
    statuses = [r.status for r in read_launches(tmp_path / "profile" / "launches.json")]
    assert statuses == ["contended, launched again", "ok"]


def test_a_contended_launch_without_room_is_flagged_and_said_in_one_line(tmp_path, no_config_check):
    machine = Machine([1.0], contended=1)
    runner = make_runner(tmp_path, machine, deadline=time.monotonic())  # no room left
    said: list[str] = []
    runner.say = said.append
    table = runner(group(1, 1, 2))
    assert len(machine.calls) == 1 and table["contended"].map(bool).all()
    (line,) = runner.answer_lines()
    assert line.startswith("contention: ") and "left out of the pick" in line
    assert line in said  # said while it runs, too


def test_a_resumed_run_launches_nothing_again(tmp_path, no_config_check):
    make_runner(tmp_path, Machine([1.0]))(group(1, 1, 2))
    machine = Machine([1.0])
    table = make_runner(tmp_path, machine)(group(1, 1, 2, 4))
    assert machine.calls == ["4:1"] and len(table) == 3


def test_the_runs_noise_floor_is_the_spread_between_the_halves_of_each_launch(tmp_path, no_config_check):
    make_runner(tmp_path, Machine([1.0]))(group(1, 1, 2))
    halves = repeat_halves(tmp_path)
    # two configs, their rounds alternating 1.00 and 1.02 of their step: each half's median the same
    assert len(halves) == 2 and all(len(h) == 2 for h in halves)
    floor, dof = run_noise_floor(tmp_path)
    assert dof == 2 and floor is not None and floor < 0.01


def test_an_adaptive_trial_asks_the_trainer_for_its_stop_rule(tmp_path):
    adaptive = TrialSettings(**{**SETTINGS.__dict__, "target_rel_halfwidth": 0.03, "max_measure_s": 8.0})
    args = trainer_args(adaptive, tmp_path / "ds.json", tmp_path)
    assert args[args.index("--max-steps") + 1] == str(1 + 6 * 5)  # warm-up + the step cap
    assert args[args.index("--profile-min-steps") + 1] == "5"
    assert args[args.index("--profile-target-halfwidth") + 1] == "0.03"
    assert args[args.index("--profile-max-seconds") + 1] == "8"
    fixed = trainer_args(SETTINGS, tmp_path / "ds.json", tmp_path)
    assert "--profile-target-halfwidth" not in fixed and fixed[fixed.index("--max-steps") + 1] == "6"


def test_the_probes_stop_rule_waits_for_a_tight_interval_or_its_time():
    from sdzero.training.measuring.probe import StopRule

    rule = StopRule(target_rel_halfwidth=0.03, min_steps=5, max_seconds=2.0)
    steady = [0.100, 0.101, 0.099, 0.100, 0.100, 0.101]
    assert rule.verdict(steady[:4]) is None  # fewer than the least steps
    assert rule.verdict(steady) == "interval"
    ragged = [0.1, 0.2, 0.13, 0.3, 0.11, 0.25, 0.15]
    assert rule.verdict(ragged) is None
    assert rule.verdict([*ragged] * 2) == "time cap"  # 2.7 s of steps, still not tight
    assert StopRule().verdict(steady * 5) is None  # no target: every step up to --max-steps
