"""The config sweep's parts that need no launch: its option, and which instruments a timed step carries
(stand-ins for DeepSpeed's engine, its ZeRO optimizer and comms logger: the CUDA paths run the same code)."""

from __future__ import annotations

from types import SimpleNamespace

import deepspeed.comm as ds_comm
import pytest
from deepspeed.runtime.engine import EngineTimers
from deepspeed.utils.timer import NoopTimer

from sdzero.errors import UserError
from sdzero.training.measuring.configs import Entry, SweepConfig, parse_configs, plan_sweep
from sdzero.training.measuring.instruments import Instruments
from sdzero.training.measuring.probe import StopRule
from sdzero.training.measuring.race import Race, race


def test_configs_parse_and_bad_ones_say_how_to_write_them() -> None:
    assert parse_configs("1:1, 4:1,4:4,8") == [
        SweepConfig(1, 1),
        SweepConfig(4, 1),
        SweepConfig(4, 4),
        SweepConfig(8, 1),
    ]
    assert SweepConfig(4, 2).key == "mb4-ga2"
    # a config with gradient checkpointing is its own config beside the same shape without
    assert parse_configs("4:1,4:1:gc") == [SweepConfig(4, 1), SweepConfig(4, 1, True)]
    assert SweepConfig(4, 1, True).key == "mb4-ga1-gc"
    for bad in ("", "0:1", "2:x", "1:1:1", "2:1,2:1", "2:1:gc:gc", "2:1:gc,2:1:gc"):
        with pytest.raises(UserError, match="--profile-configs"):
            parse_configs(bad)


def _engine(breakdown: bool) -> SimpleNamespace:
    timers = EngineTimers(enable_micro_timers=breakdown, enable_global_timers=breakdown)
    return SimpleNamespace(
        _config=SimpleNamespace(wall_clock_breakdown=breakdown),
        engine_timers=timers,
        optimizer=SimpleNamespace(timers="the engine's timers"),
    )


def test_timed_steps_run_without_the_comms_logger_and_timers_and_instrumented_ones_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ds_comm.comms_logger, "enabled", True)
    engine = _engine(breakdown=True)
    on_timers = engine.engine_timers
    instruments = Instruments(engine)
    instruments.set(False)
    # comms_logger synchronizes after every collective; the timers around every phase
    assert ds_comm.comms_logger.enabled is False
    assert engine._config.wall_clock_breakdown is False
    assert engine.engine_timers.forward_timers == [] and engine.engine_timers.step_timers == []
    assert isinstance(engine.optimizer.timers, NoopTimer)
    instruments.set(True)
    assert ds_comm.comms_logger.enabled is True and engine._config.wall_clock_breakdown is True
    assert engine.engine_timers is on_timers and engine.optimizer.timers == "the engine's timers"


def test_instrumented_steps_turn_on_only_what_the_json_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds_comm.comms_logger, "enabled", False)
    engine = _engine(breakdown=False)
    Instruments(engine).set(True)
    assert ds_comm.comms_logger.enabled is False and engine._config.wall_clock_breakdown is False


def test_the_out_of_memory_vote_travels_on_the_backends_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL takes CUDA tensors, gloo CPU ones (stand-ins for the process group and the device)."""
    import torch

    from sdzero.training.measuring import instruments

    monkeypatch.setattr(instruments.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(instruments.torch.cuda, "current_device", lambda: 3)
    assert instruments.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(instruments.dist, "get_backend", lambda: "gloo")
    assert instruments.collective_device() == torch.device("cpu")


def test_a_cuda_out_of_memory_is_told_from_other_errors() -> None:
    import torch

    from sdzero.training.measuring.instruments import is_oom

    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("[enforce fail] DefaultCPUAllocator: out of memory"))
    assert not is_oom(RuntimeError("size mismatch"))


def test_of_two_instrumented_steps_the_one_with_less_time_in_collectives_is_kept() -> None:
    """Each config is instrumented on its first and second visits; a step slowed by anything else on the
    machine only adds time to its collectives, so the lesser reading is the config's communication."""
    from sdzero.training.measuring.config_probe import ConfigProbe

    class Meter:
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def elapsed_s(self) -> float:
            return self.seconds

        def totals(self, steps: int) -> dict:
            return {"ops": {"all_reduce": {"seconds_per_step": self.seconds}}}

        def close(self) -> None:
            pass

    probe = object.__new__(ConfigProbe)  # its collectives meter and engine stood in for
    probe.kinds = {1: "instrumented", 2: "timed", 5: "instrumented", 9: "instrumented"}
    probe.comm_marks, probe.comm_result = [], None
    probe.engine = SimpleNamespace(wall_clock_breakdown=lambda: False)
    probe._disarm_instruments = lambda: None
    for step, seconds in ((1, 1.6), (2, 0.1), (5, 0.5), (9, 0.9)):
        probe.comm = Meter(seconds)
        probe.on_step_queued(None, step)
    assert probe.comm_marks == [0.5]
    assert probe.comm_totals() == {"ops": {"all_reduce": {"seconds_per_step": 0.5}}}


def test_a_config_clearly_slower_per_sample_than_the_leader_leaves_the_race() -> None:
    """(samples/s, 95% low, high, timed steps) per config: only an interval wholly below the leader's, with
    enough steps behind it, stops being measured."""
    rates = {
        "mb8-ga1": (100.0, 95.0, 105.0, 6),  # the leader
        "mb4-ga1": (90.0, 85.0, 96.0, 6),  # overlaps the leader's interval: may yet be the pick
        "mb2-ga1": (60.0, 55.0, 64.0, 6),  # wholly below: out
        "mb1-ga1": (30.0, 25.0, 35.0, 2),  # below, but on two steps only: measured on
    }
    out = race(rates, min_steps=5)
    assert set(out) == {"mb2-ga1"}
    assert out["mb2-ga1"].startswith("slower per sample than mb8-ga1 (60 vs 100 samples/s")
    assert race({"mb8-ga1": rates["mb8-ga1"]}, 5) == {}


class _Launch:
    """A launch's bookkeeping without a launch: its race's rules over (key, timed steps) per config still
    measured, 5 of its 100 s of timed steps spent."""

    def __init__(self, race_on: bool, live: list[tuple[str, int]]) -> None:
        self.race = Race(StopRule(min_steps=3, max_seconds=100.0), racing=race_on)
        self.timed_s = 5.0
        self.entries = []
        for key, steps in live:
            mb, ga = (int(p[2:]) for p in key.split("-"))
            probe = SimpleNamespace(records=[{"step_time_s": 0.1}] * steps)
            self.entries.append(Entry(SweepConfig(mb, ga), probe))  # type: ignore[arg-type]

    def done(self) -> bool:
        return self.race.done(self.entries, self.timed_s)


def _sweep(race_on: bool, live: list[tuple[str, int]]) -> _Launch:
    return _Launch(race_on, live)


def test_the_launch_ends_once_its_leader_is_the_only_config_left() -> None:
    sweep = _sweep(True, [("mb8-ga1", 4), ("mb2-ga1", 4)])
    assert not sweep.done()  # 5 of 100 s measured, two configs racing
    sweep.entries[1].raced = "round 3: slower per sample than mb8-ga1"
    assert sweep.done()  # the leader alone: decided, the other 95 s are not spent
    assert not _sweep(False, [("mb8-ga1", 4)]).done()  # without racing the time is spent


def test_configs_race_those_of_their_own_accumulation_only() -> None:
    """The check at accumulation 4 amortises the once-per-step costs: faster per sample, but no rival of
    the accumulation-1 configs, and alone in its class it is never raced out."""
    rates = {
        "mb8-ga1": (100.0, 95.0, 105.0, 6),
        "mb2-ga1": (60.0, 55.0, 64.0, 6),
        "mb8-ga4": (300.0, 290.0, 310.0, 6),
    }
    classes = {"mb8-ga1": 1, "mb2-ga1": 1, "mb8-ga4": 4}
    assert set(race(rates, 5, classes)) == {"mb2-ga1"}
    assert set(race(rates, 5)) == {"mb8-ga1", "mb2-ga1"}  # one class: the check would lead them all
    sweep = _sweep(True, [("mb8-ga1", 6), ("mb2-ga1", 6), ("mb8-ga4", 6)])
    sweep.entries[1].raced = "round 4"
    assert sweep.done()  # each accumulation's leader alone is left


def _times(sweep: _Launch, key: str, times: list[float]) -> None:
    next(e for e in sweep.entries if e.config.key == key).probe.records = [{"step_time_s": t} for t in times]


def test_the_time_the_race_saves_measures_the_configs_left_to_the_target_half_width() -> None:
    """With a target the leader alone does not end the launch: it (and any rival still within noise) is
    measured until its interval is that tight, or the launch's seconds are spent."""
    sweep = _sweep(True, [("mb8-ga1", 4), ("mb2-ga1", 4)])
    sweep.race.target = 0.03
    sweep.entries[1].raced = "round 3: slower per sample than mb8-ga1"
    _times(sweep, "mb8-ga1", [0.10, 0.14, 0.08, 0.12, 0.09])  # +-20%-ish: not decided to 3%
    assert not sweep.done()
    _times(sweep, "mb8-ga1", [0.100, 0.101, 0.099, 0.100, 0.1005, 0.0995, 0.100])
    assert sweep.done()  # as tight as asked
    _times(sweep, "mb8-ga1", [0.10, 0.14, 0.08, 0.12, 0.09])
    sweep.timed_s = 100.0
    assert sweep.done()  # the launch's seconds are spent
    sweep = _sweep(True, [("mb8-ga1", 4), ("mb4-ga1", 4)])  # a rival within noise: both to the target
    sweep.race.target = 0.03
    _times(sweep, "mb8-ga1", [0.100, 0.101, 0.099, 0.100, 0.1005, 0.0995, 0.100])
    _times(sweep, "mb4-ga1", [0.05, 0.07, 0.04, 0.06, 0.045])
    assert not sweep.done()


def test_the_race_leader_is_a_config_that_fits_the_memory_cap() -> None:
    """A faster config over --profile-memory-cap-gib cannot be the pick: it does not race out the fastest
    config that fits (micro-batch 4 with checkpointing), and it leaves the race itself once measured."""
    rates = {
        "mb8-ga1": (100.0, 97.0, 103.0, 6),  # fastest, over the cap
        "mb4-ga1-gc": (80.0, 77.0, 83.0, 6),  # fits: the leader
        "mb2-ga1": (60.0, 57.0, 63.0, 6),  # fits, clearly slower than the one that fits
    }
    out = race(rates, 5, over={"mb8-ga1"})
    assert set(out) == {"mb8-ga1", "mb2-ga1"}
    assert out["mb2-ga1"].startswith("slower per sample than mb4-ga1-gc")
    assert out["mb8-ga1"].startswith("over the memory cap")
    assert "mb4-ga1-gc" in race(rates, 5)  # without the cap the config that fits is raced out
    assert (
        race({"mb8-ga1": (100.0, 97.0, 103.0, 2), "mb4-ga1": rates["mb4-ga1-gc"]}, 5, over={"mb8-ga1"}) == {}
    )
    sweep = _sweep(True, [("mb8-ga1", 4), ("mb4-ga1", 4)])
    sweep.race.over_cap = {"mb8-ga1"}
    assert sweep.done() is False  # nothing raced out yet
    sweep.entries[0].raced = "round 2: over the memory cap"
    assert sweep.done()  # the config that fits is the leader alone


def test_a_launchs_options_are_checked_before_the_start_up() -> None:
    """`plan_sweep` reads --profile-configs and what goes with it; a combination that cannot work is one
    line, before any process group or model exists."""
    base = dict(profile_configs="1:1,4:1:gc", profile_out="p.json", buckets=False, profile_race=True)
    plan = plan_sweep(SimpleNamespace(**base, profile_memory_cap_gib=2.0, profile_min_steps=4))
    assert plan is not None and plan.configs == [SweepConfig(1, 1), SweepConfig(4, 1, True)]
    assert (plan.race, plan.memory_cap_bytes, plan.stop_rule.min_steps) == (True, 2.0 * 2**30, 4)
    assert plan_sweep(SimpleNamespace(**{**base, "profile_configs": None})) is None
    with pytest.raises(UserError, match="needs --profile-out"):
        plan_sweep(SimpleNamespace(**{**base, "profile_out": None}))
    with pytest.raises(UserError, match="with --buckets"):
        plan_sweep(SimpleNamespace(**{**base, "buckets": True}))


def test_the_launch_is_a_driver_of_the_step_not_a_callback() -> None:
    """The launch drives `train_step` itself; only its configs' probes are callbacks, and a Trainer set up
    with --profile-configs holds no one-config probe in their place."""
    from sdzero.training.callbacks import Callback
    from sdzero.training.measuring.config_probe import ConfigProbe
    from sdzero.training.measuring.probe import start_probe
    from sdzero.training.measuring.sweep import ConfigSweep

    assert not issubclass(ConfigSweep, Callback) and issubclass(ConfigProbe, Callback)
    cfg = SimpleNamespace(profile_out="p.json", profile_configs="1:1,2:1")
    assert start_probe(cfg, None, None, None) is None
