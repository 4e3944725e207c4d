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

The launch ends, after any config's turn, once `--profile-max-seconds` of steps are measured and every
config has `--profile-min-steps` timed steps.

With `--profile-race` the launch races its configs (`race`): after each round, a config with at least
`--profile-min-steps` timed steps whose samples/s interval (the 95% bootstrap interval of its median
step, sdzero.telemetry.step_interval) lies wholly below the leader's stops being measured (it keeps what it
measured; `launch.raced` says in which round and behind whom). The time the race saves goes to the configs
still in it (the leader and the rivals within its noise): the launch ends once each of their intervals is
within `--profile-target-halfwidth` (its pick decided, and its figures as tight as asked) or its time is
spent; without a target, once each leader is the only config left.
With `--profile-memory-cap-gib` a config whose device peak per rank (the largest rank's, read on its
instrumented step) is over the cap cannot be the pick: it neither leads the race nor keeps the launch going,
and once it has its least timed steps it stops being measured, its reason beginning `OVER_CAP`
(`launch.over_cap`).
Configs race those of their own accumulation only: more micro-steps a step amortise its once-per-step
costs, so a config at another accumulation (the advisor's check) is no rival, and is measured on.

FILE gets {"launch": ..., "configs": {key: profile}, "input": ...}, "input" being what one loader worker
and the storage deliver (sdzero.data.input_probe), each profile in the
single-trial format (sdzero.training.probe); FILE.partial.json the same after every round.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from sdzero.atomic import write_json_atomic
from sdzero.constants import GIB
from sdzero.data.feed import Batches
from sdzero.data.images import EpochSampler
from sdzero.errors import UserError
from sdzero.telemetry.step_interval import interval_is_tight, median_interval
from sdzero.telemetry.step_stats import StepLog
from sdzero.training.callbacks import Callback
from sdzero.training.probe import Probe, StopRule, start_probe, stop_rule

SWEEP_VERSION = 1
TIE_SIZE = 256
"""The tie's square matrices: a product of a few milliseconds on a CPU core, far less on a GPU."""
TIE_REPEATS = 8
OVER_CAP = "over the memory cap"
"""How `race` begins the reason of a config it stops for its memory (advisor.measure.launch reads it)."""
SETTLE_S = 10.0
"""Seconds of a launch's first steps that run slow whatever the model (the process's first seconds)."""


@dataclass(frozen=True)
class SweepConfig:
    """One config of a launch: the micro-batch fed to the engine, the accumulation it is told and whether
    the network recomputes its activations in the backward (gradient checkpointing)."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool = False

    @property
    def key(self) -> str:
        return f"mb{self.micro_batch}-ga{self.grad_accum}" + ("-gc" if self.checkpointing else "")


def parse_configs(text: str) -> list[SweepConfig]:
    """`1:1,2:1,4:4,8:1:gc` -> configs (`:gc`: with gradient checkpointing); one clear line for anything
    else."""
    configs: list[SweepConfig] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        pieces = part.split(":")
        gc = len(pieces) == 3 and pieces[2].strip() == "gc"
        try:
            mb, ga = (int(pieces[0]), int(pieces[1]) if len(pieces) > 1 else 1)
        except ValueError:
            mb, ga = 0, 0
        if len(pieces) > (3 if gc else 2) or mb < 1 or ga < 1:
            raise UserError(
                f"--profile-configs {text!r}: write MICRO_BATCH:ACCUMULATION pairs, e.g. 1:1,4:1,4:4, and "
                "MICRO_BATCH:ACCUMULATION:gc for one with gradient checkpointing"
            )
        configs.append(SweepConfig(mb, ga, gc))
    if not configs or len(set(configs)) != len(configs):
        raise UserError(f"--profile-configs {text!r}: at least one config, each once")
    return configs


class ConfigProbe(Probe):
    """One config's measurements inside a sweep; the sweep tells it what kind of step comes next."""

    def __init__(self, engine: Any, ds: Any, frozen: tuple[torch.nn.Module, ...], out: Path) -> None:
        super().__init__(engine, ds, frozen, out, warmup_steps=0)
        self.kinds: dict[int, str] = {}
        """Each step's kind: "warmup" (uncounted), "instrumented" (comms logger, timers, memory meters) or
        "timed" (nothing a user's run lacks). By step: on CUDA a step's record arrives a step late."""
        self.comm_result: dict[str, Any] | None = None
        self.peak_cuda: int | None = None
        self.step_at: list[float] = []
        self.loader_wait_apart = False
        """Loader workers feed the steps: their wait is taken out of the step (see on_metrics)."""
        """Epoch seconds at the end of each timed step (where the advisor puts the config in time)."""

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if self.kinds.get(step) == "instrumented":
            self._arm_instruments()
            self.comm.reset()

    def on_step_queued(self, trainer: Any, step: int) -> None:
        if self.kinds.get(step) != "instrumented":
            return
        self._disarm_instruments()
        mark = self.comm.elapsed_s()
        result = self.comm.totals(1)
        self.comm.close()
        # A config has two instrumented steps (its first and second visits); the one with less time in
        # collectives is kept: other work on the machine only ever adds time to a collective, and one
        # slowed step would be read as the config's communication (and taken out of its compute).
        kept = self.comm_marks[0] if self.comm_marks else None
        if kept is not None and mark is not None and mark >= kept:
            return
        self.comm_marks = [] if mark is None else [mark]
        self.comm_result = result
        if self.engine.wall_clock_breakdown():
            cache = self.engine.get_wall_clock_timers()
            self.ds_timers = [
                {
                    k: cache[k] / 1e3
                    for k in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
                    if k in cache
                }
            ]

    def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        if self.kinds.get(step) == "timed":
            if self.loader_wait_apart and record.get("data_s"):
                # The step without its wait on the loader workers: the input's own rate is measured apart
                # (sdzero.data.input_probe) and bounds the plan there (advisor.model.input_rate); kept in
                # the step, a trial starved by its input would be read as slow compute at every node count.
                wait = min(float(record["data_s"]), float(record["step_time_s"]))
                record = {**record, "step_time_s": record["step_time_s"] - wait, "input_wait_s": wait}
            self.records.append(record)
            self.step_at.append(time.time())

    def wants_stop(self, trainer: Any) -> bool:
        return False

    def comm_totals(self) -> dict[str, Any] | None:
        return self.comm_result

    def cuda_peak(self) -> int | None:
        return self.peak_cuda

    def figures(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        profile = self._summary(ranks)
        profile["stopped_by"] = "launch"
        profile["measured_at"] = statistics.median(self.step_at) if self.step_at else None
        return profile


@dataclass
class _Entry:
    config: SweepConfig
    probe: ConfigProbe
    visits: int = 0
    oom: str | None = None
    round_medians: list[float] = field(default_factory=list)
    raced: str | None = None
    """Why the config stopped being measured (`--profile-race`): slower per sample than the leader."""


class ConfigSweep(Callback):
    """Routes the Trainer's events to the config being measured; `run` is the launch's loop."""

    def __init__(
        self,
        cfg: Any,
        ds: Any,
        engine: Any,
        comps: Any,
        out: Path,
        configs: list[SweepConfig],
        warmup_steps: int,
        stop_rule: StopRule,
        round_steps: int = 2,
        race: bool = False,
    ) -> None:
        self.cfg, self.ds, self.engine, self.out = cfg, ds, engine, out
        self.warmup_steps, self.round_steps = warmup_steps, max(1, round_steps)
        self.min_steps = stop_rule.min_steps
        self.race = race
        self.max_seconds = stop_rule.max_seconds
        self.target = stop_rule.target_rel_halfwidth
        self.memory_cap = float(getattr(cfg, "profile_memory_cap_gib", 0.0) or 0.0) * GIB
        self.over_cap: set[str] = set()
        """Configs measured over the memory cap: they cannot be the pick (`race`'s `over`)."""
        frozen = comps.frozen_modules()
        self.entries = [_Entry(c, ConfigProbe(engine, self._ds_of(c), frozen, out)) for c in configs]
        for entry in self.entries:  # with no worker the rank decodes itself: that is its own work
            entry.probe.loader_wait_apart = cfg.num_workers > 0
        self.active: ConfigProbe | None = None
        self.tie_s: list[float] = []
        self.seconds = {"warmup": 0.0, "instrumented": 0.0, "timed": 0.0, "tie": 0.0}
        self.rounds = 0
        self._instruments = _Instruments(engine)
        self._batches: dict[int, Batches] = {}
        self.input: dict[str, Any] | None = None
        self.rank_cpu_s, self.rank_samples = 0.0, 0
        """CPU seconds this rank spent in its timed steps and the samples it took in them: what its loader
        workers cannot have of the node's cores (sdzero.data.input_probe)."""
        self.network = comps.network
        self.switches_checkpointing = any(c.checkpointing for c in configs)
        """Only a launch whose configs ask for checkpointing switches it (else the network stays as built:
        a user's --gradient-checkpointing holds for every config)."""
        if self.switches_checkpointing and not hasattr(self.network, "enable_gradient_checkpointing"):
            raise UserError(
                "--profile-configs with ':gc': this network has no gradient checkpointing to switch on"
            )

    def _ds_of(self, c: SweepConfig) -> Any:
        return replace(self.ds, micro_batch=c.micro_batch, grad_accum=c.grad_accum)

    # ------------------------------------------------------------------ events, for the active config

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if self.active is not None:
            self.active.on_step_begin(trainer, step)

    def on_step_queued(self, trainer: Any, step: int) -> None:
        if self.active is not None:
            self.active.on_step_queued(trainer, step)

    def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        if self.active is not None:
            self.active.on_metrics(trainer, step, record)

    # ------------------------------------------------------------------ the launch

    def run(self, trainer: Any) -> dict[str, Any]:
        """The launch: rounds until the measuring time is spent. Returns the RunSummary's fields (the
        trainer builds it: this module does not import the trainer)."""
        step = trainer.state.step
        while True:
            stopped = False
            for entry in self._live():
                step = self._visit(trainer, entry, step)
                # judged after every config, so the launch ends when its time is spent, not a round later
                if self.rounds and self._agree(self._done()):
                    stopped = True
                    break
            self._time_tie(trainer.device)
            self.rounds += 1
            if self.race:
                self._race()
            done = stopped or self._agree(self._done())
            self._write(self.out.with_name(self.out.stem + ".partial.json"))
            if done:
                break
        for batches in {id(b): b for b in [*self._batches.values(), trainer.batches]}.values():
            batches.close()  # no worker prefetching on any rank while one worker is timed alone
        dist.barrier()
        self.input = self._measure_input(trainer)
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

    def _live(self) -> list[_Entry]:
        return [e for e in self.entries if e.oom is None and e.raced is None]

    def _done(self) -> bool:
        live = self._live()
        if not live:
            return True
        enough = all(len(e.probe.records) >= self.min_steps for e in live)
        if not enough:
            return False
        if self.seconds["timed"] >= self.max_seconds:
            return True
        if not self.race:
            return False
        # Only the configs that may be the pick (they fit) keep the launch going.
        contenders = [e for e in live if e.config.key not in self.over_cap]
        if self.target:
            # The launch's seconds are spent on the leader and its rivals within noise until their figures
            # are as tight as asked: the pick is then decided, and what the fit reads of it is sure.
            return all(self._tight(e) for e in contenders)
        left = [e.config.grad_accum for e in contenders]
        # each accumulation's leader alone is left: the launch's pick is decided
        return any(e.raced for e in self.entries) and len(left) == len(set(left))

    def _tight(self, entry: _Entry) -> bool:
        times = [r["step_time_s"] for r in entry.probe.records]
        return len(times) >= 2 and interval_is_tight(median_interval(times), self.target)

    def _race(self) -> None:
        """Rank 0's race after a round, for every rank: configs clearly slower per sample than the leader
        leave the rounds (`race`)."""
        classes = {e.config.key: e.config.grad_accum for e in self.entries}
        self.over_cap |= self._over_cap()
        rates = self._rate_intervals()
        verdict = [race(rates, self.min_steps, classes, self.over_cap) if dist.get_rank() == 0 else {}]
        dist.broadcast_object_list(verdict, src=0)
        for entry in self.entries:
            if entry.config.key in verdict[0] and entry.raced is None:
                entry.raced = f"round {self.rounds}: {verdict[0][entry.config.key]}"

    def _over_cap(self) -> set[str]:
        """The configs whose device peak on the largest rank is over `--profile-memory-cap-gib` (a collective:
        every rank takes part, every rank gets the same set)."""
        if not self.memory_cap:
            return set()
        peaks = torch.tensor(
            [
                float(e.probe._rank_figures()["device_peak_bytes"]) if e.probe.states else 0.0
                for e in self.entries
            ],
            dtype=torch.float64,
            device=_collective_device(),
        )
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        return {
            e.config.key
            for e, peak in zip(self.entries, peaks.tolist(), strict=True)
            if peak > self.memory_cap
        }

    def _rate_intervals(self) -> dict[str, tuple[float, float, float, int]]:
        """Per live config: (samples/s, its 95% low, high, timed steps) from its timed steps."""
        out = {}
        for e in self._live():
            times = [r["step_time_s"] for r in e.probe.records]
            interval = median_interval(times)
            if not interval.median_s > 0:
                continue
            samples = e.config.micro_batch * e.config.grad_accum * dist.get_world_size()
            lo_s = interval.lo_s if interval.lo_s == interval.lo_s else interval.median_s
            hi_s = interval.hi_s if interval.hi_s == interval.hi_s else interval.median_s
            out[e.config.key] = (samples / interval.median_s, samples / hi_s, samples / lo_s, len(times))
        return out

    def _agree(self, mine: bool) -> bool:
        """Rank 0's verdict for every rank (their step times differ a little)."""
        box = [mine]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def _visit(self, trainer: Any, entry: _Entry, step: int) -> int:
        """One config's chunk of a round: warm-up and the instrumented step on the first visit, then timed
        steps. Returns the last step number taken."""
        self._switch(trainer, entry)
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
        lag = 1 if trainer.timer.mode == "events" else 0
        trainer.step_log = StepLog(
            lag, trainer.ds.global_batch, trainer.writer, self.engine.monitor, trainer._on_record, _NoBar()
        )
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
            trainer.step_log.flush()
            self.seconds[plan[-1]] += time.perf_counter() - start
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _is_oom(exc):
                raise
            oom = f"out of memory: {str(exc).splitlines()[0][:200]}"
            _free(self.engine)
        finally:
            self._instruments.set(False)
            self.active = None
        if cuda:
            peak = int(torch.cuda.max_memory_allocated())
            entry.probe.peak_cuda = max(entry.probe.peak_cuda or 0, peak)
        if self._agree_oom(oom is not None):
            self._drop(entry, oom or "out of memory on another rank")
        else:
            times = [r["step_time_s"] for r in entry.probe.records[before:]]
            if times:
                entry.round_medians.append(statistics.median(times))
        return step

    def _agree_oom(self, mine: bool) -> bool:
        flag = torch.tensor([float(mine)], device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _drop(self, entry: _Entry, reason: str) -> None:
        """The config ran out of memory: it and every larger micro-batch of its accumulation leave."""
        for other in self.entries:
            same = (other.config.grad_accum, other.config.checkpointing) == (
                entry.config.grad_accum,
                entry.config.checkpointing,
            )
            if other.oom is None and same and other.config.micro_batch >= entry.config.micro_batch:
                other.oom = reason if other is entry else f"above {entry.config.key}, which {reason}"

    def _switch(self, trainer: Any, entry: _Entry) -> None:
        c = entry.config
        engine = self.engine
        engine.set_train_micro_batch_size(c.micro_batch)
        engine.set_train_batch_size(c.micro_batch * c.grad_accum * engine.dp_world_size)
        # The accumulation boundary is (micro_steps + 1) % accumulation: at a step's end under the old
        # accumulation, zero is the same point under the new one.
        engine.micro_steps = 0
        trainer.ds = entry.probe.ds
        trainer.shape.update(micro_batch=c.micro_batch, grad_accum=c.grad_accum)
        trainer.batches = self._batches_for(trainer, c.micro_batch)
        self._checkpointing(c.checkpointing)
        self.active = entry.probe

    def _checkpointing(self, on: bool) -> None:
        """Gradient checkpointing on the built network as the config asks (the trainer's own switch,
        sdzero.training.engine, is the same call at build time)."""
        if not self.switches_checkpointing:
            return
        if on and not self.network.is_gradient_checkpointing:
            self.network.enable_gradient_checkpointing()
        elif not on and self.network.is_gradient_checkpointing:
            self.network.disable_gradient_checkpointing()

    def _batches_for(self, trainer: Any, micro_batch: int) -> Batches:
        """One feed per micro-batch over the launch's dataset (each with its own sampler: two feeds must
        not move one sampler's epoch under each other)."""
        if micro_batch not in self._batches:
            if not self._batches and trainer.batches.loader.batch_size == micro_batch:
                self._batches[micro_batch] = trainer.batches
            else:
                self._batches[micro_batch] = _feed(trainer.batches, micro_batch, self.cfg.seed)
        return self._batches[micro_batch]

    def _time_tie(self, device: torch.device) -> None:
        """The engine-independent tie: the same matrix products every round, timed (synchronized: outside
        every timed step)."""
        a = torch.ones(TIE_SIZE, TIE_SIZE, device=device)
        start = time.perf_counter()
        for _ in range(TIE_REPEATS):
            a = (a @ a) * (1.0 / TIE_SIZE)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        self.tie_s.append(elapsed)
        self.seconds["tie"] += elapsed

    def _measure_input(self, trainer: Any) -> dict[str, Any] | None:
        """Rank 0, once the configs are measured: one loader worker's rate and the storage's with the
        node's readers (sdzero.data.input_probe); the other ranks wait in the next collective."""
        if dist.get_rank() != 0:
            return None
        from sdzero.data.input_probe import measure_input
        from sdzero.telemetry.environment import local_ranks_from_env

        loader = trainer.batches.loader
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
                    "over_cap": sorted(self.over_cap),
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


class _Instruments:
    """DeepSpeed's comms_logger and wall-clock timers: on for instrumented steps only, as the JSON set them."""

    def __init__(self, engine: Any) -> None:
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.engine import EngineTimers

        self.engine, self.logger = engine, ds_comm.comms_logger
        self.logger_on = bool(self.logger.enabled)
        self.breakdown_on = bool(engine._config.wall_clock_breakdown)
        self.timers_on = engine.engine_timers
        self.timers_off = EngineTimers(enable_micro_timers=False, enable_global_timers=False)
        # ZeRO's optimizer got the engine's timers at init when the JSON asked for the breakdown: it times
        # (and on CUDA reads back) its gradient and all-gather phases every step unless they are swapped too.
        self.optimizer = getattr(engine, "optimizer", None)
        self.optimizer_timers = getattr(self.optimizer, "timers", None)

    def set(self, on: bool) -> None:
        from deepspeed.utils.timer import NoopTimer

        self.logger.enabled = self.logger_on and on
        self.engine._config.wall_clock_breakdown = self.breakdown_on and on
        self.engine.engine_timers = self.timers_on if on else self.timers_off
        if self.optimizer_timers is not None:
            self.optimizer.timers = self.optimizer_timers if on else NoopTimer()


class _NoBar:
    def update(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass


def race(
    rates: dict[str, tuple[float, float, float, int]],
    min_steps: int,
    classes: dict[str, int] | None = None,
    over: set[str] | frozenset[str] = frozenset(),
) -> dict[str, str]:
    """The configs to stop measuring, and why: those with at least `min_steps` timed steps whose samples/s
    interval (rate, lo, hi, steps) lies wholly below the leader's, the config of the highest rate among
    those of its class (`classes`: the accumulation; one class without) that fit the memory cap (`over`:
    those that do not, which cannot be the pick however fast). A config whose interval still overlaps the
    leader's may yet be the pick and goes on."""
    out: dict[str, str] = {}
    for kind in set((classes or {}).get(k, 0) for k in rates):
        mine = {k: v for k, v in rates.items() if (classes or {}).get(k, 0) == kind}
        fitting = [k for k in mine if k not in over]
        if len(mine) < 2 or not fitting:
            continue
        leader = max(fitting, key=lambda k: mine[k][0])
        floor = mine[leader][1]
        out |= {
            key: f"slower per sample than {leader} ({rate:.3g} vs {mine[leader][0]:.3g} samples/s; its "
            f"interval {lo:.3g}-{hi:.3g} below the leader's {floor:.3g})"
            for key, (rate, lo, hi, steps) in mine.items()
            if key != leader and steps >= min_steps and hi < floor
        }
        # measured enough for the fit, it cannot be the pick: its turns go to the configs that can
        out |= {
            key: f"{OVER_CAP} (it cannot be the pick; {leader} leads those that fit)"
            for key, (_, _, _, steps) in mine.items()
            if key in over and key not in out and steps >= min_steps
        }
    return out


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


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _free(engine: Any) -> None:
    """What a step that ran out of memory left behind: its gradients and the allocator's cache."""
    with contextlib.suppress(Exception):  # best effort: the step's state is broken already
        engine.optimizer.zero_grad()
    engine.micro_steps = 0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _collective_device() -> torch.device:
    """gloo takes CPU tensors, NCCL CUDA ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def start_measurements(cfg: Any, ds: Any, engine: Any, comps: Any) -> Callback | None:
    """The Trainer's measuring callback: a sweep for `--profile-configs`, else the one-config probe for
    `--profile-out` (sdzero.training.probe), else None (no measurements, no per-step cost)."""
    return start_sweep(cfg, ds, engine, comps, stop_rule(cfg)) or start_probe(cfg, ds, engine, comps)


def start_sweep(cfg: Any, ds: Any, engine: Any, comps: Any, stop_rule: StopRule) -> ConfigSweep | None:
    """The launch's sweep for `--profile-configs` (with `--profile-out`); None without it."""
    text = getattr(cfg, "profile_configs", None)
    out = getattr(cfg, "profile_out", None)
    if not text:
        return None
    if not out:
        raise UserError("--profile-configs needs --profile-out FILE (where the configs' profiles go)")
    if getattr(cfg, "buckets", False):
        raise UserError("--profile-configs with --buckets: measure bucketed data one config per launch")
    warmup = int(getattr(cfg, "profile_warmup_steps", 0) or 0)
    configs = parse_configs(text)
    race = bool(getattr(cfg, "profile_race", False))
    return ConfigSweep(cfg, ds, engine, comps, Path(out), configs, warmup, stop_rule, race=race)
