"""Every rank's own time in collectives (sdzero.training.measuring.probe.Probe) and the least and most of them in a trial's
row (advisor.measure.trials): the least is the closest measure of the transport, the spread the waiting."""

from __future__ import annotations

import math

import pandas as pd

from advisor.measure.trials import profile_columns, rank_comm_columns
from advisor.stages.scaleout_check import _comm_s
from sdzero.training.measuring.probe import Probe


class _Comm:
    """Stands in for CommMeter: this rank's logged and waited seconds over `steps` measured steps."""

    def __init__(self, seconds: float, waited: float) -> None:
        self.seconds, self.waited = seconds, waited

    def totals(self, steps: int) -> dict:
        ops = {
            "all_reduce": {"seconds_per_step": self.seconds / steps, "waited_seconds_per_step": 0.0},
            "all_gather_into_tensor": {
                "seconds_per_step": self.waited / steps,
                "waited_seconds_per_step": self.waited / steps,
            },
        }
        return {"seconds_per_step": (self.seconds + self.waited) / steps, "ops": ops}


def _probe(records: int, comm: _Comm) -> Probe:
    probe = Probe.__new__(Probe)  # the figures only: no engine to instrument
    probe.states, probe.activations, probe.frozen = None, None, ()
    probe.records = [{"step_time_s": 1.0}] * records
    probe.comm = comm
    probe.comm_marks = [0.1 * (i + 1) for i in range(records)]  # 0.1 s in collectives each step
    return probe


def test_each_rank_records_its_own_time_in_collectives_per_step(process_group):
    figures = _probe(4, _Comm(seconds=0.8, waited=0.4))._rank_figures()
    assert math.isclose(figures["comm_s"], 0.3) and math.isclose(figures["comm_waited_s"], 0.1)
    assert [round(s, 9) for s in figures["comm_step_s"]] == [
        0.1
    ] * 4  # each step's own, not the running total
    # no measured step (a run stopped in its warm-up): nothing to divide by, nothing recorded
    empty = _probe(0, _Comm(seconds=0.8, waited=0.4))._rank_figures()
    assert empty["comm_s"] is None and empty["comm_waited_s"] is None


def test_the_least_and_the_most_rank_time_in_collectives():
    ranks = [{"comm_s": 0.30}, {"comm_s": 0.12}, {"comm_s": 0.25}, {"comm_s": 0.31}]
    assert rank_comm_columns(ranks) == {"comm_min_s": 0.12, "comm_max_s": 0.31}
    # a profile written before ranks recorded it, and one without the comms logger
    assert rank_comm_columns([{"rank": 0}]) == {"comm_min_s": None, "comm_max_s": None}
    assert rank_comm_columns([{"comm_s": None}, {"comm_s": None}]) == {"comm_min_s": None, "comm_max_s": None}


def test_the_least_waiting_rank_is_told_per_step():
    """Which rank arrives last changes from step to step: each rank's mean then holds the others' steps'
    waiting (here every mean is 0.20 s) while in every step one rank spent only 0.10 s, the transport."""
    ranks = [
        {"comm_s": 0.20, "comm_step_s": [0.10, 0.25, 0.25]},
        {"comm_s": 0.20, "comm_step_s": [0.25, 0.10, 0.25]},
        {"comm_s": 0.20, "comm_step_s": [0.25, 0.25, 0.10]},
    ]
    columns = rank_comm_columns(ranks)
    assert math.isclose(columns["comm_min_s"], 0.10) and math.isclose(columns["comm_max_s"], 0.25)
    # ranks that split different numbers of steps (cannot be matched) fall back to the means
    ranks[2]["comm_step_s"] = [0.10]
    assert rank_comm_columns(ranks) == {"comm_min_s": 0.20, "comm_max_s": 0.20}


def test_a_trial_row_carries_the_least_and_most_rank_time():
    rank = {
        "model_state_bytes": {"params": 1, "grads": 1, "master": 1, "optimizer": 1},
        "model_state_total_bytes": 4,
        "bucket_bytes": 0,
        "offloaded_bytes": 0,
        "frozen_bytes": 0,
        "activation_bytes": 0,
        "cuda_peak_bytes": None,
    }
    profile = {
        "grad_accum": 1,
        "world_size": 2,
        "global_batch": 8,
        "samples_per_s": 10.0,
        "step_time_s": 0.8,
        "comm": {"seconds_per_step": 0.3, "bytes_per_step": 1e6, "ops": {}},
        "ranks": [{**rank, "rank": 0, "comm_s": 0.3}, {**rank, "rank": 1, "comm_s": 0.1}],
        "trained_params": 10,
        "device_peak_bytes": 4,
        "peak_rss_bytes": 4,
        "measured_steps": 4,
    }
    row = profile_columns(profile)
    assert (row["comm_s"], row["comm_min_s"], row["comm_max_s"]) == (0.3, 0.1, 0.3)
    # the scale-out check reads them back, NaN where a trial's table has no such column (older trials)
    table = pd.DataFrame([row])
    assert _comm_s(table, "comm_min_s") == 0.1 and _comm_s(table, "comm_max_s") == 0.3
    assert math.isnan(_comm_s(table.drop(columns=["comm_min_s"]), "comm_min_s"))


def test_the_probe_marks_each_measured_steps_time_in_collectives():
    """The running total read at the end of every measured step (not the warm-up's): the per-step split."""

    class _Meter:
        def __init__(self) -> None:
            self.total = 0.0

        def elapsed_s(self) -> float:
            self.total += 0.05
            return self.total

    probe = Probe.__new__(Probe)
    probe.warmup_steps, probe.instrument_step, probe._first_step = 1, 1, 1
    probe.comm, probe.comm_marks = _Meter(), []
    probe._handles, probe._wrapped = [], []
    probe.engine = type("_Engine", (), {"wall_clock_breakdown": lambda self: False})()
    for step in (1, 2, 3):
        probe.on_step_queued(None, step)
    assert [round(m, 9) for m in probe.comm_marks] == [0.05, 0.10]  # steps 2 and 3
