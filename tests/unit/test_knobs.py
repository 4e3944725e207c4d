"""--tune-buckets: settings predicted to matter are measured, the others are not."""

from __future__ import annotations

import pandas as pd
import pytest

from advisor.decide.knobs import KNOB_MATTERS, knob_choices, tune_buckets, worth_measuring
from advisor.model.memory import ZeroSettings
from advisor.model.network import Link, Network
from advisor.model.step_time import TimeModel

NUMELS = tuple([1000] * 40)
SLOW_HOPS = Network(1, Link(1e10, 1e-6, "intra"), Link(1e9, 2e-3, "inter"))  # 2 ms per hop across nodes


def model() -> TimeModel:
    return TimeModel({(2, "bf16", "none"): 0.05}, {"bf16": 0.0}, {})


def test_many_small_buckets_on_a_high_latency_link_are_worth_a_larger_bucket():
    small = ZeroSettings(reduce_bucket_size=2000)  # 20 reductions per micro-step
    choices = knob_choices(model(), NUMELS, small, 2, "bf16", 1, 1, 8, SLOW_HOPS)
    assert choices[0].reduce_bucket_size == 8000 and choices[0].change < -KNOB_MATTERS
    assert [c.reduce_bucket_size for c in worth_measuring(choices)] == [8000, 8000]  # off and on
    # with one bucket already, nothing on this link is worth a trial
    big = knob_choices(model(), NUMELS, ZeroSettings(reduce_bucket_size=10**6), 2, "bf16", 1, 1, 8, SLOW_HOPS)
    assert worth_measuring(big) == []
    notes = tune_buckets(
        pd.Series({"zero_stage": 2, "dtype": "bf16", "micro_batch": 1, "offload": "none"}),
        big,
        lambda specs: pytest.fail("nothing should run"),
        2,
    )
    assert "none measured" in notes[0]


def test_the_settings_that_matter_are_run_and_reported_beside_the_prediction():
    choices = knob_choices(
        model(), NUMELS, ZeroSettings(reduce_bucket_size=2000), 2, "bf16", 1, 1, 8, SLOW_HOPS
    )
    ran: list[str] = []

    def runner(specs):
        ran.extend(s.trial_id for s in specs)
        steps = [1.0] + [0.9] * (len(specs) - 1)
        return pd.DataFrame({"trial_id": [s.trial_id for s in specs], "status": "ok", "step_time_s": steps})

    best = pd.Series({"zero_stage": 2, "dtype": "bf16", "micro_batch": 1, "offload": "none"})
    notes = tune_buckets(best, choices, runner, 2)
    assert ran[0] == "z2-bf16-mb1-off-none-r2" and ran[1].endswith("-oc0-rb8000")
    assert len(notes) == 2 and "reduce_bucket_size 8,000" in notes[0] and "measured -10.0%" in notes[0]
