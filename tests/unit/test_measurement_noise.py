"""Noise in the measurements: a trial's interval, the contention check, whole-row reading of trials.csv, and the runner that puts them together (with a stand-in
trial on a simulated machine whose speed changes). The drift correction itself: test_drift.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from advisor.measure import contention
from advisor.measure.contention import CpuSample, is_contended, others_cpu_share, session_cpu_s
from advisor.measure.csv_tables import read_whole_rows
from advisor.measure.drift import (
    Bracket,
    Drift,
    write_drift,
)
from advisor.measure.duel import Z95, Leg, paired, pool, read_duels
from advisor.measure.grid import TrialSpec
from advisor.measure.runner import RunnerPolicy, TrialRunner
from advisor.measure.trial_table import TRIAL_COLUMNS, append_row, read_trials
from advisor.measure.trials import TrialOutcome, TrialSettings, trainer_args
from advisor.model.search import _duel_now, contenders
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
# The runner on a simulated machine


SETTINGS = TrialSettings(
    model="/m", data=Path("/d"), steps=5, warmup_steps=1, trial_timeout_s=60, stall_timeout_s=None
)


def fake_profile(steps: list[float], global_batch: int) -> dict:
    rank = {
        "rank": 0,
        "device_peak_bytes": 1,
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
    return {
        "grad_accum": 1,
        "world_size": 2,
        "global_batch": global_batch,
        "samples_per_s": global_batch / mean,
        "step_time_s": mean,
        "step_time_median_s": float(np.median(steps)),
        "ranks": [rank, {**rank, "rank": 1}],
        "trained_params": 1,
        "device_peak_bytes": 1,
        "peak_rss_bytes": 1,
        "measured_steps": len(steps),
        "step_times_s": steps,
        "stopped_by": "interval",
    }


class Machine:
    """A stand-in trial: config step time x the machine's slowness at the (fake) clock, contended on
    request; every call advances the clock by 20 s."""

    def __init__(self, slowness, contended: dict[str, int] | None = None) -> None:
        self.slowness, self.contended = slowness, dict(contended or {})
        self.clock, self.calls = 1.7e9, []

    def __call__(self, spec: TrialSpec, settings, config: Path, trial_dir: Path, env=None) -> TrialOutcome:
        self.clock += 20.0
        self.calls.append((spec.trial_id, trial_dir.name))
        true = 0.1 * spec.micro_batch * (1 + 0.2 * spec.zero_stage)
        slow = self.slowness(self.clock)
        share = 0.0
        if self.contended.get(spec.trial_id, 0) > 0:
            self.contended[spec.trial_id] -= 1
            share, slow = 0.45, slow * 1.8
        steps = [true * slow * (1 + 0.01 * ((i % 3) - 1)) for i in range(8)]
        return TrialOutcome(
            "ok",
            "",
            fake_profile(steps, spec.micro_batch * 2),
            20.0,
            0,
            trial_dir / "log.txt",
            others_cpu_share=share,
            measured_at=self.clock,
        )


def make_runner(tmp_path: Path, machine: Machine, **policy) -> TrialRunner:
    return TrialRunner(
        SETTINGS,
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "train_micro_batch_size_per_gpu": 1},
        tmp_path / "profile",
        "setup",
        say=lambda line: None,
        drift_path=tmp_path / "drift.json",
        policy=RunnerPolicy(**policy),
        run_trial=machine,
    )


SPECS = [TrialSpec(stage, "bf16", mb, "none", 2) for stage in (1, 2) for mb in (1, 2, 4, 8)]


@pytest.fixture
def no_config_check(monkeypatch):
    monkeypatch.setattr("advisor.measure.runner.write_trial_config", lambda base, spec, d, w: d / "ds.json")


def test_the_reference_brackets_the_trials_and_the_rows_are_corrected(tmp_path, no_config_check):
    slow_from = 1.7e9 + 70  # the machine computes 30% slower from the fourth call on
    machine = Machine(lambda t: 1.3 if t > slow_from else 1.0)
    runner = make_runner(tmp_path, machine, bracket_every=3, rerun_jump=math.inf)
    runner(SPECS[:4])  # the seeds
    table = runner(SPECS[4:7])  # a batch (the check trials): a bracket closes it
    names = [name for _, name in machine.calls]
    assert names.count("bracket-1") == 1 and names.count("bracket-2") == 1  # after 3 trials, and closing
    assert names[-1] == "bracket-2"
    assert len(table) == 7 and set(table["trial_id"]) == {s.trial_id for s in SPECS[:7]}  # no bracket rows
    true = {s.trial_id: 0.1 * s.micro_batch * (1 + 0.2 * s.zero_stage) for s in SPECS}
    late = table[table["measured_at"] > slow_from + 30]  # well inside the slow spell, after a bracket
    assert len(late) and (late["drift_factor"] > 1.25).all()
    error = (table["step_time_median_s"] / table["trial_id"].map(true) - 1).abs()
    raw_error = (table["step_s_raw"] / table["trial_id"].map(true) - 1).abs()
    assert error[late.index].max() < 0.02 and raw_error[late.index].min() > 0.25
    assert (table["step_s_lo"] <= table["step_time_median_s"]).all()
    assert (table["step_time_median_s"] <= table["step_s_hi"]).all()
    drift = json.loads((tmp_path / "drift.json").read_text())
    assert drift["reference"] == SPECS[0].trial_id and len(drift["reference_step_s"]) == 3
    assert drift["noise_floor"] == pytest.approx((1 - 1 / 1.3) / 3)  # repeats at 1.0, 1.3, 1.3 x


def test_a_contended_trial_is_run_again_once_and_flagged_if_it_stays_so(tmp_path, no_config_check):
    once, twice = SPECS[1].trial_id, SPECS[2].trial_id
    machine = Machine(lambda t: 1.0, contended={once: 1, twice: 2})
    runner = make_runner(tmp_path, machine, bracket_every=0)
    table = runner(SPECS[:4]).set_index("trial_id")
    ran = [trial for trial, _ in machine.calls]
    assert ran.count(once) == 2 and ran.count(twice) == 2 and ran.count(SPECS[3].trial_id) == 1
    assert not table.loc[once, "contended"] and table.loc[twice, "contended"]
    assert table.loc[twice, "step_s_lo"] < table.loc[twice, "step_time_median_s"] * 0.6  # widened
    every_row = read_trials(tmp_path / "profile" / "trials.csv")
    assert (every_row["trial_id"] == once).sum() == 2  # the contended attempt stays in the history
    assert any("flagged" in line for line in runner.answer_lines())


def test_a_gap_with_too_much_drift_is_measured_again(tmp_path, no_config_check):
    machine = Machine(lambda t: 1.0 if t < 1.7e9 + 50 else 1.5)  # a jump inside the first gap
    runner = make_runner(tmp_path, machine, bracket_every=3, rerun_jump=0.2)
    runner(SPECS[:5])
    ran = [trial for trial, name in machine.calls if not name.startswith("bracket")]
    assert ran.count(SPECS[1].trial_id) + ran.count(SPECS[2].trial_id) + ran.count(SPECS[3].trial_id) >= 4
    # the re-runs confirm the jump, so every trial measured before it in the gap is run again
    assert ran.count(SPECS[1].trial_id) == 2
    assert json.loads((tmp_path / "drift.json").read_text())["reruns"]


def test_drift_re_runs_leave_the_batchs_own_trials_their_room(tmp_path, no_config_check, monkeypatch):
    # The budget's clock is the machine's (20 s a trial). A jump inside the first gap would have its
    # three trials run again; the batch whose first trial finds the bracket due (two trials) was counted
    # on by the caller, so the re-runs take only what the deadline leaves beside those two.
    machine = Machine(lambda t: 1.0 if t < 1.7e9 + 50 else 1.5)
    monkeypatch.setattr("advisor.measure.runner.time.monotonic", lambda: machine.clock)
    runner = make_runner(tmp_path, machine, bracket_every=3, rerun_jump=0.2)
    runner.deadline = machine.clock + 8 * 20.0 + 1  # 4 seeds, a bracket, one re-run, the batch of 2
    runner(SPECS[:4])
    runner(SPECS[4:6])  # the batch (the check trials)
    names = [name for _, name in machine.calls]
    ran = [trial for trial, name in machine.calls if not name.startswith("bracket")]
    assert names.count("bracket-1") == 1 and ran[-2:] == [SPECS[4].trial_id, SPECS[5].trial_id]
    assert len(ran) == 4 + 1 + 2  # one re-run: a second would have pushed the batch past the deadline
    assert machine.clock <= runner.deadline  # and no closing bracket: no room was left for one


def test_a_jump_the_first_re_runs_disprove_stops_the_re_runs(tmp_path, no_config_check):
    # The reference's own first run was fast (a lone 0.7x minute); the machine did not change after it.
    first_call = 1.7e9 + 20
    machine = Machine(lambda t: 0.7 if t == first_call else 1.0)
    runner = make_runner(tmp_path, machine, bracket_every=3, rerun_jump=0.2)
    runner(SPECS[:5])
    ran = [trial for trial, name in machine.calls if not name.startswith("bracket")]
    again = [trial for trial in {s.trial_id for s in SPECS[1:4]} if ran.count(trial) > 1]
    assert len(again) == 1  # one re-run showed the machine steady: the other two were not run again
    drift = json.loads((tmp_path / "drift.json").read_text())
    assert [r["trial_id"] for r in drift["reruns"]] == again
    assert runner.drift.correction_at(first_call + 30).jump < 0.2


def test_a_resumed_run_runs_nothing_again(tmp_path, no_config_check):
    machine = Machine(lambda t: 1.0)
    make_runner(tmp_path, machine, bracket_every=3)(SPECS[:3])
    again = Machine(lambda t: 1.0)
    table = make_runner(tmp_path, again, bracket_every=3)(SPECS[:3])
    assert again.calls == [] and len(table) == 3


# --------------------------------------------------------------------------------------------------
# The search's rematch and the trial's own stop rule


def rates_table(rows: list[tuple[str, float, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "trial_id": t,
                "status": "ok",
                "global_batch": 8,
                "step_time_median_s": s,
                "step_s_lo": lo,
                "step_s_hi": hi,
            }
            for t, s, lo, hi in rows
        ]
    )


def test_contenders_are_the_fastest_and_the_best_config_within_its_interval():
    close = rates_table([("a", 1.00, 0.97, 1.03), ("b", 1.02, 0.99, 1.06), ("c", 1.5, 1.45, 1.55)])
    assert contenders(close) == ["a", "b"]
    apart = rates_table([("a", 1.00, 0.99, 1.01), ("b", 1.10, 1.08, 1.12)])
    assert contenders(apart) == ["a"]
    assert contenders(pd.DataFrame({"trial_id": ["a"], "status": ["ok"]})) == []


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
    from sdzero.training.probe import StopRule

    rule = StopRule(target_rel_halfwidth=0.03, min_steps=5, max_seconds=2.0)
    steady = [0.100, 0.101, 0.099, 0.100, 0.100, 0.101]
    assert rule.verdict(steady[:4]) is None  # fewer than the least steps
    assert rule.verdict(steady) == "interval"
    ragged = [0.1, 0.2, 0.13, 0.3, 0.11, 0.25, 0.15]
    assert rule.verdict(ragged) is None
    assert rule.verdict([*ragged] * 2) == "time cap"  # 2.7 s of steps, still not tight
    assert StopRule().verdict(steady * 5) is None  # no target: every step up to --max-steps


# --------------------------------------------------------------------------------------------------
# The duel: A B B A, close in time


def _leg(trial: str, step: float, at: float, half: float = 0.01) -> Leg:
    return Leg(trial, step, step * (1 - half), step * (1 + half), at)


def test_a_duel_cancels_a_drift_linear_over_its_legs():
    # b is truly 10% faster; the machine slows 6% per leg, which alone would favour whoever ran first.
    slow = [1.06**i for i in range(4)]
    truth = (1.0, 0.9, 0.9, 1.0)
    legs = [_leg(t, base * s, i) for i, (t, base, s) in enumerate(zip("abba", truth, slow, strict=True))]
    duel = paired("a", "b", legs)
    assert duel.pairs == 2 and not duel.tied
    assert math.exp(duel.log_ratio) == pytest.approx(1 / 0.9, rel=0.002)
    assert "b is faster" in duel.line()
    first_leg_only = math.log(legs[0].step_s / legs[1].step_s)  # A then B once: the drift is in it
    assert abs(first_leg_only - math.log(1 / 0.9)) > 0.05


def test_a_duel_between_equal_configs_on_a_jumpy_machine_is_a_tie():
    legs = [_leg("a", 1.00, 0), _leg("b", 1.08, 1), _leg("b", 0.95, 2), _leg("a", 1.03, 3)]
    duel = paired("a", "b", legs)
    assert duel.tied and "within noise" in duel.line()
    # the pairs' spread is in the interval, beside the legs' own noise
    assert duel.halfwidth > Z95 * math.sqrt(4 * (0.01 / Z95) ** 2) / 2


def test_a_duel_between_micro_batches_is_judged_by_throughput_not_by_step():
    # a: micro-batch 8, steps 1.9x b's at micro-batch 4: a longer step, yet 8/1.9 = 4.21 samples per
    # unit against b's 4.00, so a is 5.3% faster in samples/s (the step ratio alone says b by 1.9x)
    legs = [_leg("a", 1.90, 0, 0.004), _leg("b", 1.00, 1, 0.004), _leg("b", 1.00, 2, 0.004)]
    legs.append(_leg("a", 1.90, 3, 0.004))
    duel = paired("a", "b", legs, batch_ratio=8 / 4)
    assert math.exp(duel.rate_log_ratio) == pytest.approx(8 / 1.9 / 4, rel=1e-6)
    assert not duel.tied and "a is faster" in duel.line() and "1.053x the samples/s of b" in duel.line()
    same = paired("a", "b", legs)  # as if both took the same batch: b's shorter step wins
    assert "b is faster" in same.line() and same.rate_log_ratio == pytest.approx(-duel.log_ratio)
    # within noise when the throughputs are close: 8/2.0 against 4/1.0
    close = paired(
        "a", "b", [_leg("a", 2.0, 0), _leg("b", 1.0, 1), _leg("b", 1.02, 2), _leg("a", 2.0, 3)], 2.0
    )
    assert close.tied and "within noise" in close.line()


def test_pooled_legs_carry_their_spread_not_only_their_own_intervals():
    steady = pool([_leg("a", 1.0, 0), _leg("a", 1.0, 10)])
    jumpy = pool([_leg("a", 0.9, 0), _leg("a", 1.1, 10)])
    assert steady.step_s == pytest.approx(1.0) and steady.at == 5 and steady.legs == 2
    assert jumpy.step_s == pytest.approx(math.sqrt(0.99))
    assert jumpy.sigma > 5 * steady.sigma


def test_a_rematch_with_room_runs_a_duel_and_pools_its_legs(tmp_path, no_config_check):
    machine = Machine(lambda t: 1.0)
    runner = make_runner(tmp_path, machine, bracket_every=0)
    a, b = SPECS[3], SPECS[7]  # z1 mb8, z2 mb8
    runner([a, b])
    machine.calls.clear()
    table = runner.rematch([a.trial_id, b.trial_id])
    assert machine.calls == [
        (a.trial_id, "duel-1"),
        (b.trial_id, "duel-2"),
        (b.trial_id, "duel-3"),
        (a.trial_id, "duel-4"),
    ]
    duels = read_duels(tmp_path / "duel.json", "setup")
    assert len(duels) == 1 and duels[0].pairs == 2 and not duels[0].tied  # 0.1*8*1.2 vs 0.1*8*1.4
    assert math.exp(duels[0].log_ratio) == pytest.approx(1.2 / 1.4, rel=0.02)
    rows = table.set_index("trial_id")
    assert "duel legs" in rows.at[a.trial_id, "notes"] and rows.at[a.trial_id, "stopped_by"] == "duel"
    assert rows.at[a.trial_id, "step_time_median_s"] == pytest.approx(0.96, rel=0.02)
    history = read_trials(tmp_path / "profile" / "trials.csv")
    assert (history["trial_id"] == a.trial_id).sum() == 2  # the first trial kept, the pooled row after it
    assert any(line.startswith("duel:") for line in runner.answer_lines())
    from advisor.model.uncertainty import run_noise_floor

    # the run's repeats: each config's first trial and its two legs (the pooled rows are not counted)
    assert run_noise_floor(tmp_path)[1] == 2 * (3 - 1)


def test_a_duel_leg_that_fails_leaves_the_rows_as_they_were(tmp_path, no_config_check):
    machine = Machine(lambda t: 1.0, contended={SPECS[7].trial_id: 0})
    runner = make_runner(tmp_path, machine, bracket_every=0)
    a, b = SPECS[3], SPECS[7]
    before = runner([a, b])
    machine.contended[b.trial_id] = 2  # both of b's legs lose the cores
    after = runner.rematch([a.trial_id, b.trial_id])
    assert len(machine.calls) == 4  # a, b, then a's leg and b's contended leg: abandoned there
    assert not (tmp_path / "duel.json").exists()
    pd.testing.assert_frame_equal(before, after)


def test_the_search_stops_one_trial_early_to_leave_room_for_a_duel():
    class WithRematch:
        def rematch(self, ids):
            return None

    close = rates_table([("a", 1.00, 0.97, 1.03), ("b", 1.02, 0.99, 1.06)])
    apart = rates_table([("a", 1.00, 0.99, 1.01), ("b", 1.10, 1.08, 1.12)])
    assert _duel_now(WithRematch(), close, 20.0, 90.0)  # room for 4 legs, not for 5 trials
    assert not _duel_now(WithRematch(), close, 20.0, 120.0)  # room for one more trial first
    assert not _duel_now(WithRematch(), close, 20.0, 70.0)  # no room for the legs
    assert not _duel_now(WithRematch(), apart, 20.0, 90.0)  # nothing to tell apart
    assert not _duel_now(lambda specs: None, close, 20.0, 90.0)  # a replay has no rematch


def test_the_reference_is_a_middle_rung_first_in_the_seeds_and_in_a_profile(tmp_path, no_config_check):
    from advisor.measure.grid import GridRequest, plan_grid
    from advisor.model.search import seed_specs

    plan = plan_grid(
        GridRequest(stages=(1, 2), precisions=("bf16",), micro_batches=(1, 2, 4, 8), ranks_per_node=(2,)),
        {"bf16": True},
    )
    assert plan.reference is not None and plan.reference.micro_batch == 4
    seeds = seed_specs(plan)
    assert seeds[0] == plan.reference and {s.micro_batch for s in seeds[1:]} == {1}
    machine = Machine(lambda t: 1.0)
    runner = TrialRunner(
        SETTINGS,
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "train_micro_batch_size_per_gpu": 1},
        tmp_path / "profile",
        "setup",
        drift_path=tmp_path / "drift.json",
        policy=RunnerPolicy(bracket_every=2),
        run_trial=machine,
        reference=plan.reference,
    )
    for spec in plan.ladders[0]:  # a profile climbs the ladder: micro-batch 1 and 2 run before it
        runner.run_one(spec)
    assert runner.drift.reference == plan.reference.trial_id


def test_an_oom_below_the_wanted_reference_hands_the_role_to_the_next_success(tmp_path, no_config_check):
    from advisor.measure.runner import _rules_out

    ref = SPECS[2]  # z1 mb4
    assert _rules_out(SPECS[1], "oom", ref) and _rules_out(ref, "crash", ref)
    assert not _rules_out(SPECS[1], "ok", ref) and not _rules_out(SPECS[5], "oom", ref)  # another ladder


def test_the_runs_noise_floor_pools_every_repeat_it_made(tmp_path):
    from advisor.measure.duel import write_duels
    from advisor.model.uncertainty import MEAN_ABS_TO_SIGMA, run_noise_floor

    assert run_noise_floor(tmp_path) == (None, 0)  # no repeats: no floor
    write_drift(
        tmp_path / "drift.json",
        Drift("ref", "setup", [Bracket(t, s, s, s) for t, s in ((0.0, 1.0), (60.0, 1.1), (120.0, 0.9))]),
    )
    legs = [_leg("a", 2.0, 0), _leg("b", 1.0, 1), _leg("b", 1.2, 2), _leg("a", 2.0, 3)]
    write_duels(tmp_path / "duel.json", "setup", [paired("a", "b", legs)])
    floor, dof = run_noise_floor(tmp_path)
    assert dof == 2 + 1 + 1  # three brackets, two legs of each duel config
    logs = [math.log(v) for v in (1.0, 1.1, 0.9)]
    squares = sum((v - sum(logs) / 3) ** 2 for v in logs) + 2 * (math.log(1.2) / 2) ** 2
    assert floor == pytest.approx(math.sqrt(squares / dof) / MEAN_ABS_TO_SIGMA)


class OutlierBracket(Machine):
    """A steady machine whose reference measures 40% slow once, at its first re-measure."""

    def __call__(self, spec, settings, config, trial_dir, env=None):
        outcome = super().__call__(spec, settings, config, trial_dir, env)
        if trial_dir.name == "bracket-1":
            outcome.profile = {**outcome.profile}
            outcome.profile["step_times_s"] = [s * 1.4 for s in outcome.profile["step_times_s"]]
            outcome.profile["step_time_median_s"] *= 1.4
        return outcome


def test_the_runner_fits_its_drift_to_the_trials_it_ran_twice(tmp_path, no_config_check):
    machine = OutlierBracket(lambda t: 1.0)
    runner = make_runner(tmp_path, machine, bracket_every=3, rerun_jump=0.2)
    runner(SPECS[:4])  # the seeds
    table = runner(SPECS[4:6])  # bracket 1 jumps 40%: its gap's trials run again; a bracket closes the batch
    names = [name for _, name in machine.calls]
    assert "bracket-1" in names and names[-1].startswith("bracket-") and names[-1] != "bracket-1"
    true = {s.trial_id: 0.1 * s.micro_batch * (1 + 0.2 * s.zero_stage) for s in SPECS}
    error = (table["step_time_median_s"] / table["trial_id"].map(true) - 1).abs()
    clean = runner.drift.clean()  # the brackets' own interpolation, as the correction was before the fit
    times, steps = [b.at for b in clean], [b.step_s / clean[0].step_s for b in clean]
    naive = table["step_s_raw"] / table["measured_at"].map(lambda t: float(np.interp(t, times, steps)))
    naive_error = (naive / table["trial_id"].map(true) - 1).abs()
    assert naive_error.max() > 0.15  # the outlier, interpolated into its neighbours
    assert error.max() < naive_error.max() / 2
    drift = json.loads((tmp_path / "drift.json").read_text())
    # the first re-run of the gap already showed the machine steady: the fitted jump fell below the
    # policy, and the gap's other two trials were not run again
    assert {r["trial_id"] for r in drift["repeats"]} == {SPECS[1].trial_id}
    assert [r["trial_id"] for r in drift["reruns"]] == [SPECS[1].trial_id]


def test_a_duel_across_micro_batches_writes_its_batch_ratio(tmp_path, no_config_check):
    machine = Machine(lambda t: 1.0)
    runner = make_runner(tmp_path, machine, bracket_every=0)
    a, b = SPECS[3], SPECS[2]  # z1 mb8 (step 0.96 s), z1 mb4 (step 0.48 s): the same samples/s
    runner([a, b])
    runner.rematch([a.trial_id, b.trial_id])
    (duel,) = read_duels(tmp_path / "duel.json", "setup")
    assert math.exp(duel.batch_log_ratio) == pytest.approx(2.0)
    assert math.exp(duel.log_ratio) == pytest.approx(2.0, rel=0.02)  # mb8's step is twice mb4's
    assert abs(duel.rate_log_ratio) < 0.02 and duel.tied
