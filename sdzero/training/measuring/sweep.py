"""Several configs measured in one launch: `--profile-configs MB:GA,MB:GA,...` with `--profile-out FILE`.

One launch loads the model, the frozen encoders and the data once and builds one DeepSpeed engine (one ZeRO
stage, precision and offload); then it measures each listed (micro-batch, accumulation) config with the
trainer's own `train_step`, in interleaved rounds, A B C A B C ...: a few steps of each config per round,
so that the machine's drift over the launch falls on every config alike instead of on whichever ran in a
slow minute. ZeRO partitions and buckets never depend on the micro-batch (DeepSpeed's zero/ code does not
read it): a config is the batch the same engine is fed and its accumulation
(`engine.set_train_micro_batch_size`, `engine.set_train_batch_size`). A config may also switch gradient
checkpointing on (`MB:GA:gc`): the built network's `enable_gradient_checkpointing()` before its steps and
`disable_gradient_checkpointing()` before the next config's, so recomputation is measured beside the
configs that store their activations, in the same launch. Checkpointing changes neither ZeRO's partitions
nor its buckets, only what the forward keeps for the backward.

Each config's first visit is uncounted: `--profile-warmup-steps` steps (the launch's first config only),
one *instrumented* step, the only kind with DeepSpeed's comms_logger and wall-clock timers on (the logger
synchronizes after every collective and the timers around every phase: in a timed step they would remove
the overlap of communication and compute that a user's run has), which also reads the model states and
the activation bytes, and while the launch's first seconds last a round's worth of steps more. Its second
visit starts with a second instrumented step, and the config keeps the one of the two that spent less time
in collectives (a step slowed by anything else would otherwise be read as its communication). Every
other step is *timed*: nothing on in it that a user's run does not have.

A *tie* is timed at the end of every round: a fixed matrix product that depends on no engine, so that
launches of different engines can be put on one machine speed (advisor.measure.launch).

A config that runs out of memory is marked `oom`, its memory freed, and it leaves the rounds with every
config of the same accumulation and checkpointing at its micro-batch or above; the launch goes on. (A rank that runs out
while the others wait in a collective cannot be saved in-process: the advisor sees the launch stall, keeps
the configs already written and launches the rest again without it.)

When the launch has measured enough, and which configs leave it before with `--profile-race`, is
sdzero.training.measuring.race's to say.

`ConfigSweep(trainer, plan).run()` is the launch's driver: it takes a built Trainer (`Trainer.setup`) and
drives its `train_step` itself, round after round. Before a config's steps it tells the engine the config's
batch, hands the Trainer the config's feed and shape (`trainer.use_batch_shape`) and installs the config's
probe (sdzero.training.measuring.config_probe) in the Trainer's measuring slot (`trainer.measure_with`),
where a one-config trial's probe sits: measuring a step stays a callback's job, choosing the steps is the
driver's. sdzero.training.trainer.run picks this driver for `--profile-configs`.

FILE gets {"launch": ..., "configs": {key: profile}, "input": ...}, "input" being what one loader worker
and the storage deliver (sdzero.data.input_probe), each profile in the single-trial format
(sdzero.training.measuring.probe); FILE.partial.json the same after every round.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from sdzero.atomic import write_json_atomic
from sdzero.data.feed import Batches
from sdzero.data.images import EpochSampler
from sdzero.errors import UserError
from sdzero.telemetry.step_interval import median_interval
from sdzero.training.callbacks import Callback, TrainerView
from sdzero.training.measuring.config_probe import ConfigProbe
from sdzero.training.measuring.configs import Entry, SweepConfig, SweepPlan
from sdzero.training.measuring.instruments import (
    Instruments,
    any_rank,
    free_after_oom,
    is_oom,
    rank0_says,
    time_tie,
)
from sdzero.training.measuring.race import Race, live_entries

SWEEP_VERSION = 1
SETTLE_S = 10.0
"""Seconds of a launch's first steps that run slow whatever the model (the process's first seconds)."""


class DrivenTrainer(TrainerView, Protocol):
    """What the driver uses of the Trainer (sdzero.training.trainer.Trainer satisfies it): its step, its
    measuring slot and its batch shape; declared here so that this module never imports the Trainer."""

    ds: Any
    writer: Any
    skipped_images: int
    step_log: Any

    def train_step(self, step: int) -> bool: ...

    def measure_with(self, probe: Callback) -> None: ...

    def use_batch_shape(self, ds: Any, batches: Any) -> None: ...

    def open_step_log(self, bar: Any) -> Any: ...


class ConfigSweep:
    """A launch of several configs: `run` measures them in interleaved rounds through the Trainer's step."""

    def __init__(self, trainer: DrivenTrainer, plan: SweepPlan, round_steps: int = 2) -> None:
        self.trainer, self.plan = trainer, plan
        self.cfg, self.ds, self.engine, self.out = trainer.cfg, trainer.ds, trainer.engine, plan.out
        self.warmup_steps, self.round_steps = plan.warmup_steps, max(1, round_steps)
        self.race = Race(plan.stop_rule, plan.race, plan.memory_cap_bytes)
        frozen = trainer.comps.frozen_modules()
        self.entries = [
            Entry(c, ConfigProbe(self.engine, self._ds_of(c), frozen, self.out)) for c in plan.configs
        ]
        for entry in self.entries:  # with no worker the rank decodes itself: that is its own work
            entry.probe.loader_wait_apart = self.cfg.num_workers > 0
        self.tie_s: list[float] = []
        self.seconds = {"warmup": 0.0, "instrumented": 0.0, "timed": 0.0, "tie": 0.0}
        self.rounds = 0
        self._instruments = Instruments(self.engine)
        self._batches: dict[int, Batches] = {}
        self.input: dict[str, Any] | None = None
        self.rank_cpu_s, self.rank_samples = 0.0, 0
        """CPU seconds this rank spent in its timed steps and the samples it took in them: what its loader
        workers cannot have of the node's cores (sdzero.data.input_probe)."""
        self.network = trainer.comps.network
        self.switches_checkpointing = any(c.checkpointing for c in plan.configs)
        """Only a launch whose configs ask for checkpointing switches it (else the network stays as built:
        a user's --gradient-checkpointing holds for every config)."""
        if self.switches_checkpointing and not hasattr(self.network, "enable_gradient_checkpointing"):
            raise UserError(
                "--profile-configs with ':gc': this network has no gradient checkpointing to switch on"
            )

    def _ds_of(self, c: SweepConfig) -> Any:
        return replace(self.ds, micro_batch=c.micro_batch, grad_accum=c.grad_accum)

    # ------------------------------------------------------------------ the launch

    def run(self) -> dict[str, Any]:
        """The launch: rounds until the measuring time is spent. Returns the RunSummary's fields (the
        trainer builds it: this module does not import the trainer)."""
        trainer = self.trainer
        step = trainer.state.step
        while True:
            stopped = False
            for entry in live_entries(self.entries):
                step = self._visit(entry, step)
                # judged after every config, so the launch ends when its time is spent, not a round later
                if self.rounds and rank0_says(self._done()):
                    stopped = True
                    break
            tie = time_tie(trainer.device)
            self.tie_s.append(tie)
            self.seconds["tie"] += tie
            self.rounds += 1
            if self.race.racing:
                self.race.judge(self.entries, self.rounds)
            done = stopped or rank0_says(self._done())
            self._write(self.out.with_name(self.out.stem + ".partial.json"))
            if done:
                break
        for batches in {id(b): b for b in [*self._batches.values(), trainer.batches]}.values():
            batches.close()  # no worker prefetching on any rank while one worker is timed alone
        dist.barrier()
        self.input = self._measure_input()
        self._write(self.out)
        if trainer.writer is not None:
            trainer.writer.close()
        rates = [r["samples_per_s"] for e in self.entries for r in e.probe.records if r.get("samples_per_s")]
        losses = [r["loss"] for e in self.entries for r in e.probe.records if r.get("loss") is not None]
        return dict(
            steps=step,
            first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"),
            mean_samples_per_s=statistics.fmean(rates) if rates else 0.0,
            metrics_path=str(self.cfg.output_dir / "metrics.jsonl"),
            skipped_images=trainer.skipped_images,
        )

    def _done(self) -> bool:
        return self.race.done(self.entries, self.seconds["timed"])

    def _visit(self, entry: Entry, step: int) -> int:
        """One config's chunk of a round: warm-up and the instrumented step on the first visit, then timed
        steps. Returns the last step number taken."""
        trainer = self.trainer
        self._switch(entry)
        plan = ["timed"] * self.round_steps
        if entry.visits == 0:
            # The first round is all warm-up. The launch's first config takes the warm-up steps (JIT
            # builds, Adam's states made in the first optimizer step); every config's instrumented step
            # takes its own shapes' allocations. While the launch's first SETTLE_S of steps are not
            # spent, a round more: its steps ran about twice as long as later rounds' on the CPU
            # (workers, allocator); a large model's first steps spend them at once.
            warm = 0 if any(e.visits for e in self.entries) else self.warmup_steps
            plan = ["warmup"] * warm + ["instrumented"]
            if self.seconds["warmup"] + self.seconds["instrumented"] < SETTLE_S:
                plan += ["warmup"] * self.round_steps
        elif entry.visits == 1:
            # the second reading of its collectives (ConfigProbe keeps the lesser of the two)
            plan = ["instrumented", *plan]
        entry.visits += 1
        before = len(entry.probe.records)
        oom = None
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        # A step's statistics are read a step late on CUDA (as in Trainer.train): no sync per step; the
        # chunk's last line is read at its end.
        step_log = trainer.open_step_log(_NoBar())
        try:
            for kind in plan:
                step += 1
                entry.probe.kinds[step] = kind
                self._instruments.set(kind == "instrumented")
                start, cpu = time.perf_counter(), time.process_time()
                trainer.train_step(step)
                self.seconds[kind] += time.perf_counter() - start
                if kind == "timed":  # the rank's own CPU seconds (its threads; not its loader workers')
                    self.rank_cpu_s += time.process_time() - cpu
                    self.rank_samples += trainer.ds.micro_batch * trainer.ds.grad_accum
            start = time.perf_counter()
            step_log.flush()
            self.seconds[plan[-1]] += time.perf_counter() - start
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc):
                raise
            oom = f"out of memory: {str(exc).splitlines()[0][:200]}"
            free_after_oom(self.engine)
        finally:
            self._instruments.set(False)
        if cuda:
            peak = int(torch.cuda.max_memory_allocated())
            entry.probe.peak_cuda = max(entry.probe.peak_cuda or 0, peak)
        if any_rank(oom is not None):
            self._drop(entry, oom or "out of memory on another rank")
        else:
            times = [r["step_time_s"] for r in entry.probe.records[before:]]
            if times:
                entry.round_medians.append(statistics.median(times))
        return step

    def _drop(self, entry: Entry, reason: str) -> None:
        """The config ran out of memory: it and every larger micro-batch of its accumulation leave."""
        for other in self.entries:
            same = (other.config.grad_accum, other.config.checkpointing) == (
                entry.config.grad_accum,
                entry.config.checkpointing,
            )
            if other.oom is None and same and other.config.micro_batch >= entry.config.micro_batch:
                other.oom = reason if other is entry else f"above {entry.config.key}, which {reason}"

    def _switch(self, entry: Entry) -> None:
        """The config's turn: the engine told its batch, the Trainer given its feed, shape and probe."""
        c = entry.config
        engine = self.engine
        engine.set_train_micro_batch_size(c.micro_batch)
        engine.set_train_batch_size(c.micro_batch * c.grad_accum * engine.dp_world_size)
        # The accumulation boundary is (micro_steps + 1) % accumulation: at a step's end under the old
        # accumulation, zero is the same point under the new one.
        engine.micro_steps = 0
        self.trainer.use_batch_shape(entry.probe.ds, self._batches_for(c.micro_batch))
        self._checkpointing(c.checkpointing)
        self.trainer.measure_with(entry.probe)

    def _checkpointing(self, on: bool) -> None:
        """Gradient checkpointing on the built network as the config asks (the trainer's own switch,
        sdzero.training.engine, is the same call at build time)."""
        if not self.switches_checkpointing:
            return
        if on and not self.network.is_gradient_checkpointing:
            self.network.enable_gradient_checkpointing()
        elif not on and self.network.is_gradient_checkpointing:
            self.network.disable_gradient_checkpointing()

    def _batches_for(self, micro_batch: int) -> Batches:
        """One feed per micro-batch over the launch's dataset (each with its own sampler: two feeds must
        not move one sampler's epoch under each other)."""
        current = self.trainer.batches
        if micro_batch not in self._batches:
            if not self._batches and current.loader.batch_size == micro_batch:
                self._batches[micro_batch] = current
            else:
                self._batches[micro_batch] = _feed(current, micro_batch, self.cfg.seed)
        return self._batches[micro_batch]

    def _measure_input(self) -> dict[str, Any] | None:
        """Rank 0, once the configs are measured: one loader worker's rate and the storage's with the
        node's readers (sdzero.data.input_probe); the other ranks wait in the next collective."""
        if dist.get_rank() != 0:
            return None
        from sdzero.data.input_probe import measure_input
        from sdzero.telemetry.environment import local_ranks_from_env

        loader = self.trainer.batches.loader
        try:
            measured = measure_input(
                loader.dataset,
                self.cfg.seed,
                self.cfg.num_workers,
                local_ranks_from_env(),
                self.ds.micro_batch,
                loader.collate_fn,
            )
        except (OSError, RuntimeError, ValueError) as exc:  # the configs' figures stand without it
            return {"error": f"{type(exc).__name__}: {exc}"}
        if self.rank_samples:
            measured["rank_cpu_s_per_sample"] = self.rank_cpu_s / self.rank_samples
        records = [r for e in self.entries for r in e.probe.records]
        waited = sum(r.get("input_wait_s", 0.0) for r in records)
        # the share of the timed steps' wall time the rank waited on its workers (before it was taken out)
        measured["loader_wait_share"] = waited / max(1e-9, waited + sum(r["step_time_s"] for r in records))
        return measured

    # ------------------------------------------------------------------ the result

    def _write(self, path: Path) -> None:
        """Every config's profile, gathered from every rank (a collective), written by rank 0."""
        mine = {e.config.key: e.probe._rank_figures() for e in self.entries if e.probe.records}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() != 0:
            return
        configs = {}
        for e in self.entries:
            if e.config.key in ranks[0]:
                configs[e.config.key] = e.probe.figures([r[e.config.key] for r in ranks])
                configs[e.config.key]["checkpointing"] = e.config.checkpointing
        write_json_atomic(
            path,
            {
                "version": SWEEP_VERSION,
                "launch": {
                    "rounds": self.rounds,
                    "round_steps": self.round_steps,
                    "warmup_steps": self.warmup_steps,
                    "seconds": self.seconds,
                    "tie_s": self.tie_s,
                    "oom": {e.config.key: e.oom for e in self.entries if e.oom},
                    "raced": {e.config.key: e.raced for e in self.entries if e.raced},
                    "over_cap": sorted(self.race.over_cap),
                    "round_medians_s": {e.config.key: e.round_medians for e in self.entries},
                    "intervals": {
                        e.config.key: median_interval(
                            [r["step_time_s"] for r in e.probe.records]
                        ).rel_halfwidth
                        for e in self.entries
                        if len(e.probe.records) > 1
                    },
                },
                "configs": configs,
                "input": self.input,  # None in the partial file, written before it is measured
            },
        )


class _NoBar:
    def update(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass


def _feed(batches: Batches, micro_batch: int, seed: int) -> Batches:
    loader = batches.loader
    sampler = EpochSampler(len(loader.dataset), batches.sampler.rank, batches.sampler.world_size, seed=seed)
    workers = loader.num_workers
    new = DataLoader(
        loader.dataset,
        batch_size=micro_batch,
        sampler=sampler,
        drop_last=True,
        collate_fn=loader.collate_fn,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
    )
    return Batches(new, sampler)
