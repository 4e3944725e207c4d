"""The Trainer's events and its callbacks, in one process: a one-rank gloo group, a stand-in engine, the
model's loss replaced by the step number (sdzero.training.trainer, sdzero.training.callbacks)."""

from __future__ import annotations

import functools
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from step_input_fakes import step_input
from trainer_fakes import FakeEngine, FakeEvent

from sdzero.errors import UserError
from sdzero.models.families import family_named
from sdzero.models.objectives import FlowSettings
from sdzero.process.preemption import EXIT_PREEMPTED, Preempted, PreemptionFlag
from sdzero.telemetry.phase_timers import PhaseTimer
from sdzero.training import trainer as trainer_module
from sdzero.training.callbacks import (
    CALLBACKS_ENV,
    Callback,
    CheckpointCallback,
    PreemptionCallback,
    extra_callbacks,
    load_callbacks,
    overrides,
)
from sdzero.training.trainer import Trainer
from sdzero.training.trainer_parts import DataSide, ModelSide, RunSettings


class Feed:
    """Endless micro-batches of 2 samples each, with the data position a checkpoint records."""

    def __init__(self) -> None:
        self.epoch, self.batches_in_epoch, self.samples_in_epoch = 0, 0, 0

    def next(self):
        self.batches_in_epoch += 1
        self.samples_in_epoch += 2
        return step_input(index=torch.tensor([self.samples_in_epoch - 2, self.samples_in_epoch - 1]))

    def check_late(self) -> int:
        return 0


class Recorder(Callback):
    """Appends (name, event, args) to a shared list for every event; votes to stop from `stop_from`."""

    def __init__(self, name: str, events: list, stop_from: int | None = None) -> None:
        self.name, self.events, self.stop_from = name, events, stop_from

    def _add(self, event: str, *args) -> None:
        self.events.append((self.name, event, *args))

    def on_setup(self, trainer) -> None:
        self._add("setup")

    def on_step_begin(self, trainer, step) -> None:
        self._add("begin", step)

    def on_batch(self, trainer, batch) -> None:
        self._add("batch", batch.index.tolist())

    def on_optimizer_step(self, trainer, step) -> None:
        self._add("optimizer", step)

    def wants_stop(self, trainer) -> bool:
        self._add("vote")
        steps = sum(1 for e in self.events if e[:2] == (self.name, "optimizer"))
        return self.stop_from is not None and steps >= self.stop_from

    def on_step_queued(self, trainer, step) -> None:
        self._add("queued", step)

    def on_metrics(self, trainer, step, record) -> None:
        self._add("metrics", step, record["loss"])

    def on_step_end(self, trainer, step) -> None:
        self._add("end", step, trainer.state.step)

    def on_stop(self, trainer, step) -> None:
        self._add("stop", step)

    def on_checkpoint_staged(self, trainer, step, folder) -> None:
        self._add("staged", step)

    def on_finish(self, trainer) -> None:
        self._add("finish", trainer.state.step)


def make_trainer(
    monkeypatch, tmp_path, callbacks, mode: str = "host", steps: int = 2, family: str = "sd", measuring=None
):
    """A Trainer of `steps` steps x 2 micro-steps, timed as on a CPU ("host") or on CUDA ("events")."""
    monkeypatch.setattr(trainer_module, "timing_mode", lambda device, sync: mode)
    monkeypatch.setattr(trainer_module, "PhaseTimer", functools.partial(PhaseTimer, event_factory=FakeEvent))
    monkeypatch.setattr(trainer_module, "encode_batch", lambda comps, batch: (None, None))
    engine = FakeEngine()
    losses: list = []

    def loss(inputs, objective):
        losses.append(objective)
        return torch.tensor(float(engine.global_samples // 2 + 1))  # the step number

    network_family = family_named(family)
    monkeypatch.setattr(network_family, "loss", loss)  # the registered object, restored after the test
    flow_calls: list = []
    # The fake run options carry their flow settings ready-made; FlowSettings.from_config reads them.
    monkeypatch.setattr(FlowSettings, "from_config", staticmethod(lambda cfg: cfg.flow_settings()))
    cfg = SimpleNamespace(
        max_steps=steps,
        sync_timing=False,
        export_final=False,
        output_dir=tmp_path,
        snr_gamma=None,
        flow_settings=lambda: flow_calls.append(1) or "the flow settings",
    )
    ds = SimpleNamespace(grad_accum=2, global_batch=4, zero_stage=2, dtype="fp32", micro_batch=2)
    comps = SimpleNamespace(family=network_family, noise_scheduler=None)
    trainer = Trainer(
        RunSettings(cfg, ds, torch.device("cpu")),
        ModelSide(comps, engine, "epsilon"),
        DataSide(Feed()),
        callbacks=callbacks,
        measuring=measuring,
    )
    return trainer, SimpleNamespace(losses=losses, flow_calls=flow_calls)


def test_events_come_in_order_and_callbacks_in_list_order(monkeypatch, tmp_path, process_group):
    events: list = []
    trainer, _ = make_trainer(monkeypatch, tmp_path, [Recorder("a", events), Recorder("b", events)])
    summary = trainer.train()
    assert summary.steps == 2 and (summary.first_loss, summary.last_loss) == (1.0, 2.0)
    a = [e[1:] for e in events if e[0] == "a"]
    assert a == [
        ("setup",),
        ("begin", 1),
        ("batch", [0, 1]),
        ("batch", [2, 3]),
        ("optimizer", 1),
        ("vote",),
        ("queued", 1),
        ("metrics", 1, 1.0),  # on a CPU the line is read at its own step's end
        ("end", 1, 1),  # trainer.state is the finished step's
        ("begin", 2),
        ("batch", [4, 5]),
        ("batch", [6, 7]),
        ("optimizer", 2),
        ("vote",),
        ("queued", 2),
        ("metrics", 2, 2.0),
        ("end", 2, 2),
        ("finish", 2),
    ]
    # every event reaches "a" before "b"
    assert [e[0] for e in events] == [name for _ in a for name in ("a", "b")]
    assert trainer.state.samples_in_epoch == 8 and trainer.state.batches_in_epoch == 4


def test_on_cuda_a_steps_metrics_come_after_the_next_step_is_queued(monkeypatch, tmp_path, process_group):
    events: list = []
    trainer, _ = make_trainer(monkeypatch, tmp_path, [Recorder("a", events)], mode="events", steps=3)
    trainer.train()
    order = [e[1:] for e in events if e[1] in ("queued", "metrics", "end", "finish")]
    assert order == [
        ("queued", 1),
        ("end", 1, 1),
        ("queued", 2),
        ("metrics", 1, 1.0),
        ("end", 2, 2),
        ("queued", 3),
        ("metrics", 2, 2.0),
        ("end", 3, 3),
        ("metrics", 3, 3.0),  # the last line after the loop, before the finish
        ("finish", 3),
    ]


def test_an_agreed_stop_writes_its_line_then_stops_instead_of_ending_the_step(
    monkeypatch, tmp_path, process_group
):
    """Nobody turns the stop into an exit here, so the run ends at that step and finishes normally."""
    events: list = []
    trainer, _ = make_trainer(monkeypatch, tmp_path, [Recorder("a", events, stop_from=2)], steps=5)
    summary = trainer.train()
    tail = [e[1:] for e in events][-5:]
    assert tail == [("vote",), ("queued", 2), ("metrics", 2, 2.0), ("stop", 2), ("finish", 2)]
    assert summary.steps == 2 and trainer.state.step == 2


def test_flow_settings_are_resolved_once_not_per_micro_step(monkeypatch, tmp_path, process_group):
    trainer, seen = make_trainer(monkeypatch, tmp_path, [], steps=3, family="sd3")
    trainer.train()
    assert len(seen.flow_calls) == 1 and len(seen.losses) == 6
    assert {objective.flow for objective in seen.losses} == {"the flow settings"}
    trainer, seen = make_trainer(monkeypatch, tmp_path, [], steps=1)
    trainer.train()
    assert seen.flow_calls == [] and seen.losses[0].flow is None


class FakeCheckpointer:
    """Records saves; like the real one, announces the staged folder before it commits."""

    def __init__(self, events: list) -> None:
        self.events, self.before_commit = events, None

    def save(self, state) -> None:
        self.before_commit(state.step, Path("staging"))
        self.events.append(("checkpointer", "commit", state.step))


def test_checkpoints_at_the_cadence_and_the_end_with_the_staged_event_before_each_commit(
    monkeypatch, tmp_path, process_group
):
    events: list = []
    checkpoints = CheckpointCallback(FakeCheckpointer(events), every=2)
    trainer, _ = make_trainer(monkeypatch, tmp_path, [checkpoints, Recorder("a", events)], steps=3)
    trainer.train()
    saves = [e for e in events if e[1] in ("staged", "commit")]
    assert saves == [
        ("a", "staged", 2),
        ("checkpointer", "commit", 2),
        ("a", "staged", 3),  # the final checkpoint: step 3 is not a multiple of 2
        ("checkpointer", "commit", 3),
    ]


def test_preemption_saves_then_exits_143_at_the_agreed_step(monkeypatch, tmp_path, process_group):
    events: list = []
    flag = PreemptionFlag(timeout_s=60)
    flag.signum = signal.SIGTERM  # as if SIGTERM had arrived (no watchdog started)
    callbacks = [CheckpointCallback(FakeCheckpointer(events), every=0), PreemptionCallback(flag)]
    trainer, _ = make_trainer(monkeypatch, tmp_path, [*callbacks, Recorder("a", events)], steps=5)
    with pytest.raises(Preempted) as stopped:
        trainer.train()
    assert stopped.value.code == EXIT_PREEMPTED
    assert ("checkpointer", "commit", 1) in events  # saved at the first step, where the vote was read
    assert not any(e[1] in ("stop", "finish") for e in events if e[0] == "a")  # raised before later ones


def test_only_overridden_events_are_dispatched(monkeypatch, tmp_path, process_group):
    class Quiet(Callback):
        def on_finish(self, trainer) -> None:
            self.finished = True

    quiet = Quiet()
    assert overrides(quiet, "on_finish") and not overrides(quiet, "on_batch")
    trainer, _ = make_trainer(monkeypatch, tmp_path, [quiet])
    assert trainer._handlers["on_batch"] == [] and len(trainer._handlers["on_finish"]) == 1
    trainer.train()
    assert quiet.finished


def test_a_probe_installed_in_the_measuring_slot_keeps_the_callbacks_order(
    monkeypatch, tmp_path, process_group
):
    """What a launch of several configs does per config (sdzero.training.measuring.sweep): the probe takes
    the measuring callback's place, between the callbacks before it and after it, and the one it replaced
    hears nothing more."""
    events: list = []
    slot = Callback()  # Trainer.setup's empty slot: no events
    first, second = Recorder("m1", events), Recorder("m2", events)
    trainer, _ = make_trainer(
        monkeypatch, tmp_path, [Recorder("a", events), slot, Recorder("b", events)], measuring=slot
    )
    trainer.measure_with(first)
    trainer.train(until=1)
    trainer.measure_with(second)
    trainer.train(until=2)
    begins = [(e[0], e[2]) for e in events if e[1] == "begin"]
    assert begins == [("a", 1), ("m1", 1), ("b", 1), ("a", 2), ("m2", 2), ("b", 2)]
    assert trainer.callbacks[1] is second and trainer.measuring is second
    bare, _ = make_trainer(monkeypatch, tmp_path, [])
    with pytest.raises(ValueError, match="no measuring slot"):
        bare.measure_with(first)


def test_a_new_batch_shape_takes_effect_at_the_next_step(monkeypatch, tmp_path, process_group):
    """`use_batch_shape`: the micro-steps per step and the shape on the metrics line follow the new
    settings, drawn from the new feed (one engine, configs switched between steps)."""
    events: list = []
    trainer, _ = make_trainer(monkeypatch, tmp_path, [Recorder("a", events)])
    lines: list = []
    trainer.writer = SimpleNamespace(write=lines.append, close=lambda: None)
    trainer.train(until=1)
    feed = Feed()
    ds = SimpleNamespace(grad_accum=3, global_batch=6, zero_stage=2, dtype="fp32", micro_batch=2)
    trainer.use_batch_shape(ds, feed)
    trainer.train(until=2)
    batches = [e[2] for e in events if e[1] == "batch"]
    assert len(batches) == 2 + 3 and feed.batches_in_epoch == 3
    assert [(r["micro_batch"], r["grad_accum"]) for r in lines] == [(2, 2), (2, 3)]


def test_extra_callbacks_are_loaded_from_module_attribute_names(monkeypatch, tmp_path):
    (tmp_path / "my_callbacks.py").write_text(
        "from sdzero.training.callbacks import Callback\n"
        "class Mine(Callback):\n    pass\n"
        "def make():\n    return Mine()\n"
        "def nothing():\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = load_callbacks("my_callbacks:make, my_callbacks:nothing,")
    assert [type(c).__name__ for c in found] == ["Mine"]  # a factory may decline (None)
    monkeypatch.setenv(CALLBACKS_ENV, "my_callbacks:make")
    assert len(extra_callbacks()) == 1
    monkeypatch.delenv(CALLBACKS_ENV)
    assert extra_callbacks() == []
    for bad in ("my_callbacks:missing", "no_such_module_here:make", "my_callbacks"):
        with pytest.raises(UserError, match=f"{CALLBACKS_ENV}: cannot load"):
            load_callbacks(bad)
    sys.modules.pop("my_callbacks", None)


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": i}


def test_closing_the_batches_stops_the_loader_workers_which_ignore_sigterm():
    """Else a finished run's exit waits on them for ever (multiprocessing joins its children at exit)."""
    from torch.utils.data import DataLoader

    from sdzero.data.feed import Batches
    from sdzero.data.images import EpochSampler
    from sdzero.process.preemption import ignore_preemption_signals

    sampler = EpochSampler(8, 0, 1, seed=0)
    loader = DataLoader(
        Numbers(),
        batch_size=2,
        sampler=sampler,
        num_workers=1,
        persistent_workers=True,
        worker_init_fn=ignore_preemption_signals,
    )
    batches = Batches(loader, sampler)
    assert len(batches.next()["index"]) == 2
    workers = list(batches._it._workers)
    assert workers and all(w.is_alive() for w in workers)
    batches.close()
    assert not any(w.is_alive() for w in workers)


@pytest.fixture
def library_logging_restored(monkeypatch):
    """quiet_libraries changes process-wide logging (filters, levels, warnings.showwarning, progress bars):
    put it all back, so that the tests after this one see the libraries as they were."""
    import logging
    import warnings

    import diffusers
    import transformers

    from sdzero.library_logs import LIBRARY_LOGGERS

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    saved = [(lg, lg.level, list(lg.filters), [(h, list(h.filters)) for h in lg.handlers]) for lg in loggers]
    root_handlers = list(logging.getLogger().handlers)
    show = warnings.showwarning
    verbosity = (diffusers.utils.logging.get_verbosity(), transformers.utils.logging.get_verbosity())
    yield
    warnings.showwarning = show
    for lg, level, filters, handlers in saved:
        lg.setLevel(level)
        lg.filters[:] = filters
        lg.__dict__.pop("addHandler", None)  # the filtering addHandler put on the instance
        for handler, handler_filters in handlers:
            handler.filters[:] = handler_filters
    for handler in logging.getLogger().handlers:
        if handler not in root_handlers:  # logging.basicConfig's, where the root had none
            logging.getLogger().removeHandler(handler)
    diffusers.utils.logging.set_verbosity(verbosity[0])
    transformers.utils.logging.set_verbosity(verbosity[1])
    diffusers.utils.logging.enable_progress_bar()
    transformers.utils.logging.enable_progress_bar()


def test_joining_a_run_sends_rank_0s_library_chatter_to_library_log(
    monkeypatch, tmp_path, library_logging_restored
):
    """join_run quiets the libraries with the run's output folder: their chatter is kept in library.log
    (it was dropped when the folder was not passed), and a library's error still reaches the console."""
    import logging
    import warnings

    from sdzero.config.train_config import TrainConfig
    from sdzero.process.distributed import Ranks
    from sdzero.training.run_output import LIBRARY_LOG

    monkeypatch.setattr(
        trainer_module, "start_distributed", lambda timeout_s: Ranks(0, 1, 0, torch.device("cpu"))
    )
    monkeypatch.setattr(trainer_module, "check_shared_storage", lambda *args: None)
    monkeypatch.setattr(trainer_module, "find_resume", lambda *args: None)
    cfg = TrainConfig(
        deepspeed_config=tmp_path / "ds.json", model="m", data=tmp_path, output_dir=tmp_path / "run"
    )
    ranks, point = trainer_module.join_run(cfg, SimpleNamespace(zero_stage=2, dtype="bf16", raw={}))
    assert ranks.rank == 0 and point is None

    console = []
    handler = logging.Handler()
    handler.emit = lambda record: console.append(record.getMessage())  # type: ignore[method-assign]
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addHandler(handler)
    try:
        deepspeed_logger.warning("Setting accelerator to CPU")
        logging.getLogger("diffusers.models.modeling_utils").warning("a diffusers notice")
        deepspeed_logger.error("a real DeepSpeed failure")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("old API", FutureWarning, "/x/site-packages/torch/c10d_logger.py", 83)
    finally:
        deepspeed_logger.removeHandler(handler)
    text = (cfg.output_dir / LIBRARY_LOG).read_text()
    assert "Setting accelerator to CPU" in text and "a diffusers notice" in text
    assert "FutureWarning: old API" in text
    assert "a real DeepSpeed failure" not in text and console == ["a real DeepSpeed failure"]
