"""Did another process take the cores while a trial measured? CPU time that was neither the trial's nor ours.

Over a trial's measured window the machine's busy CPU time (/proc/stat: user, nice, system, irq, softirq
and steal, all CPUs) is compared with the CPU time of the trial's own processes (every process of its
session: the launcher, the ranks, their data-loader workers; /proc/<pid>/stat, reaped children included)
and of this process. What is left was spent by someone else: another training on the same cores, a
neighbour's job, the hypervisor's steal. As a share of the machine's cores it is the `others_cpu_share`
of the trial; above CONTENDED_SHARE the trial is *contended*: its step times were measured on fewer cores
than the configuration gets when it runs alone, so they are not fitted as clean (advisor.measure.launch
launches it again, or flags it).

This cannot see a machine whose every core computes slower for a minute (a shared physical core of a
virtual machine: bench/testbed_noise.py); measuring the configs side by side in one launch puts that
minute on all of them alike.
Linux only: elsewhere the samples are None and no trial is called contended.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CONTENDED_SHARE = 0.15
"""Share of the machine's cores taken by other processes over a trial's window above which the trial is
contended. A one-rank training beside a 2-rank trial on 2 cores takes about half of them; system daemons
and an idle shell take a few percent."""

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""/proc/stat `cpu` line fields counted as busy: user, nice, system, irq, softirq, steal (guest time is
inside user already; idle and iowait are not busy)."""

PROC = Path("/proc")


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds so far, read at one moment (`at`, monotonic)."""

    at: float
    machine_busy_s: float
    trial_s: float
    own_s: float


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def machine_busy_s(proc: Path = PROC) -> float | None:
    """Busy CPU seconds of the whole machine since boot (all CPUs); None without /proc/stat."""
    try:
        line = (proc / "stat").read_text().split("\n", 1)[0]
    except OSError:
        return None
    fields = line.split()[1:]
    if not line.startswith("cpu ") or len(fields) < 8:
        return None
    return sum(float(fields[i]) for i in _BUSY_FIELDS) / _ticks()


def session_cpu_s(session: int, proc: Path = PROC) -> float:
    """CPU seconds of every live process in `session` (its own and its reaped children's)."""
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # exited between the listing and the read
            continue
        # "pid (comm) state ppid pgrp session ... utime stime cutime cstime": comm may hold spaces and ')'
        rest = text[text.rfind(")") + 2 :].split()
        if len(rest) > 14 and int(rest[3]) == session:
            total += sum(int(v) for v in rest[11:15])
    return total / _ticks()


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def sample(session: int, proc: Path = PROC) -> CpuSample | None:
    busy = machine_busy_s(proc)
    if busy is None:
        return None
    return CpuSample(time.monotonic(), busy, session_cpu_s(session, proc), own_cpu_s())


def others_cpu_share(first: CpuSample, last: CpuSample, cores: int | None = None) -> float | None:
    """Share of the machine's cores that processes other than the trial's and ours used between two
    samples; None when they are too close together to tell."""
    wall = last.at - first.at
    cores = cores or os.cpu_count() or 1
    if wall <= 0:
        return None
    others = (
        (last.machine_busy_s - first.machine_busy_s)
        - (last.trial_s - first.trial_s)
        - (last.own_s - first.own_s)
    )
    return max(others, 0.0) / (wall * cores)


def is_contended(share: float | None) -> bool:
    return share is not None and share > CONTENDED_SHARE


def contention_line(trial_id: str, share: float, cores: int | None = None) -> str:
    """The one line that says it."""
    cores = cores or os.cpu_count() or 1
    return (
        f"contention: other processes took {share * cores:.2f} of the {cores} cores ({share:.0%}) while "
        f"{trial_id} measured"
    )
