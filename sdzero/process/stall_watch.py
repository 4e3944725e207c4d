"""A stall named while the run is on: which rank, on which host, in which phase, at which step.

Every rank runs a `StallWatch` thread beside its loop (it never touches the loop's tensors nor the process
group). Per host, and across hosts through the shared output folder, without any collective:

- each thread beats in its own rank's progress record (sdzero.telemetry.progress) every POLL_S;
- the host's publisher, the lowest rank of the host whose thread still beats, copies the host's records
  into `<output-dir>/progress/host-<lowest rank>-<host>.json` every PUBLISH_S (one small file per host;
  a stopped or dead process stops beating, and another rank of its host takes over);
- the leader, the publisher of the host that holds the lowest rank among the host files still being
  rewritten, reads them all and keeps, per rank, when its position (step, phase, phase entry) last
  changed, on its own monotonic clock: no two hosts' clocks are compared. When no rank has advanced for
  --stall-seconds, once every rank has reached the training loop, it writes `stall.json` and one line per
  group of ranks, then sets the host's stop flag;
- every publisher that finds `stall.json` sets its host's stop flag, and every rank that finds its host's
  flag writes its NCCL flight recorder dump (NCCL runs only) and exits with EXIT_STALLED, which
  `sdzero train`, `sdzero launch` and the Slurm script treat as restartable from the last checkpoint.
  A rank that cannot exit (stopped, in uninterruptible I/O) is ended by its launcher when its peers exit,
  or by `sdzero train` / `sdzero launch` (sdzero.process.stall_exit).

A host file is a few hundred bytes per rank, rewritten once a second; the leader reads every host file,
the other publishers only those of hosts whose lowest rank is lower than theirs, until one is fresh.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from sdzero.process.link_check import LinkCheck, rendezvous
from sdzero.telemetry.progress import (
    CODES,
    COLLECTIVE_PHASES,
    LOOP_FROM,
    ProgressRecord,
    Snapshot,
    read_host,
)

EXIT_STALLED = 142
"""128 + SIGALRM: a watchdog ended the job. No new checkpoint; resume from the newest complete one. In the
128-255 range, so the Kubernetes manifests' ExitCode policy restarts the pod, and above 137 (a SIGKILLed
rank) so that srun, which reports the highest code of its tasks, reports this one."""
STALL_FILE = "stall.json"
PROGRESS_DIR = "progress"
FLIGHT_RECORDER_DIR = "flight_recorder"
STOP_FLAG = "STALLED"
POLL_S = 0.5
PUBLISH_S = 1.0
BEAT_STALE_S = 5.0
"""A rank's watcher that has not beaten for this long is not responding (stopped, or its process is gone)."""
HOST_STALE_S = 5.0
"""A host file not rewritten for this long (on the reader's clock): its publisher is not responding."""


def host_file_name(min_rank: int, host: str) -> str:
    return f"host-{min_rank:05d}-{host}.json"


def link_file_name(rank: int) -> str:
    return f"link-{rank:05d}.json"


def snapshot_dict(s: Snapshot) -> dict[str, Any]:
    return asdict(s)


def write_quick(path: Path, text: str) -> None:
    """A whole-file replace without fsync: a host file is rewritten every second and only read live."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class RankView:
    """What the leader knows of one rank."""

    snapshot: Snapshot
    changed_at: float
    """The leader's monotonic time at which this rank's position last changed."""
    responding: bool = True


@dataclass
class Leader:
    """The leader's bookkeeping across polls (only the leading host's publisher fills it)."""

    world: int
    ranks: dict[int, RankView] = field(default_factory=dict)
    armed: bool = False
    cut_off: set[str] = field(default_factory=set)
    """Hosts whose last host file says they cannot reach the rendezvous (sdzero.process.link_check)."""
    ended: bool = False
    """A rank finished or left: the run is ending, and no stall is named any more."""

    def observe(self, snaps: list[tuple[Snapshot, bool]], now: float) -> None:
        seen = set()
        for snap, responding in snaps:
            seen.add(snap.rank)
            view = self.ranks.get(snap.rank)
            if view is None or view.snapshot.position() != snap.position():
                self.ranks[snap.rank] = RankView(snap, now, responding)
            else:
                view.snapshot, view.responding = snap, responding
            if snap.phase == "finished":
                self.ended = True
        if self.armed and seen != set(self.ranks):
            self.ended = True  # a rank's record went away: it exited (its launcher reacts to that)
        loop = [v for v in self.ranks.values() if v.snapshot.position()[1] >= LOOP_FROM]
        if not self.armed and len(loop) == self.world:
            self.armed = True

    def stalled_for(self, now: float) -> float:
        """Seconds since any rank last advanced (0 at the run's end). Before every rank reached the loop,
        only while a rank is not responding (a stopped or gone process): a start-up phase may rightly
        take longer than --stall-seconds (an op build, a download), a silent watcher never does."""
        if self.ended or not self.ranks:
            return 0.0
        if not self.armed:
            silent = any(not v.responding for v in self.ranks.values())
            if not silent or len(self.ranks) < self.world:
                return 0.0
        return now - max(v.changed_at for v in self.ranks.values())


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> "0-2, 4, 6-7"."""
    parts: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def _who(ranks: list[RankView]) -> str:
    numbers = [v.snapshot.rank for v in ranks]
    hosts = sorted({v.snapshot.host for v in ranks})
    head = f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {rank_ranges(numbers)}"
    return f"{head} ({', '.join(hosts)})"


def cut_off_ranks(views: list[RankView], cut_off: set[str]) -> tuple[list[RankView], str]:
    """The ranks of the host whose link is down, and why it is named: the hosts that cannot reach the
    rendezvous, or, when every host but one is cut off (3 hosts or more), that one: its own link."""
    hosts = {v.snapshot.host for v in views}
    cut = cut_off & hosts
    if not cut:
        return [], ""
    if len(hosts) >= 3 and len(hosts - cut) == 1:
        return [
            v for v in views if v.snapshot.host not in cut
        ], " (no other host reaches it: its link is down)"
    return [v for v in views if v.snapshot.host in cut], " (its host cannot reach the rendezvous: link down)"


def describe_stall(
    views: dict[int, RankView], now: float, cut_off: set[str] | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """One line per group of ranks, the ranks holding the job first: those not responding if any, else
    those on a host whose link is down, else those furthest behind (lowest step, then earliest phase);
    the others are waiting on them."""
    all_views = sorted(views.values(), key=lambda v: v.snapshot.rank)
    silent = [v for v in all_views if not v.responding]
    linked, why = cut_off_ranks(all_views, cut_off or set())
    if silent:
        culprits, why = silent, ""
    elif linked:
        culprits = linked
    else:
        behind = min(v.snapshot.position()[:2] for v in all_views)
        culprits = [v for v in all_views if v.snapshot.position()[:2] == behind]
        if len(culprits) == len(all_views):
            culprits = []
    culprit_ranks = {v.snapshot.rank for v in culprits}
    groups: dict[tuple[bool, int, str], list[RankView]] = {}
    for v in all_views:
        key = (v.snapshot.rank in culprit_ranks, v.snapshot.step, v.snapshot.phase)
        groups.setdefault(key, []).append(v)
    lines, records = [], []
    for (held, step, phase), members in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1:])):
        seconds = now - max(v.changed_at for v in members)
        if held or not culprits:
            state = " (not responding)" if not members[0].responding else why if held else ""
            line = f"{_who(members)} in {phase} at step {step:,} for {seconds:.0f} s{state}"
        else:
            verb = "waiting in" if phase in COLLECTIVE_PHASES else "in"
            line = f"{_who(members)} {verb} {phase} at step {step:,}"
        lines.append(line)
        records.append(
            {
                "ranks": [v.snapshot.rank for v in members],
                "hosts": sorted({v.snapshot.host for v in members}),
                "step": step,
                "phase": phase,
                "seconds": round(seconds, 1),
                "holding_the_job": held,
                "responding": all(v.responding for v in members),
                "link_down": bool(held and why),
            }
        )
    return lines, records


class StallWatch:
    """The watcher thread of one rank (see the module docstring); `start()` once the record is open."""

    def __init__(
        self,
        record: ProgressRecord,
        records_folder: Path,
        output_dir: Path,
        stall_seconds: float,
        *,
        nccl: bool = False,
        exit_fn: Any = os._exit,
    ) -> None:
        self.record, self.records_folder = record, records_folder
        self.output_dir, self.stall_seconds = Path(output_dir), stall_seconds
        self.progress_dir = self.output_dir / PROGRESS_DIR
        self.nccl, self.exit_fn = nccl, exit_fn
        self.world: int | None = None
        self.publishing = False
        self.leader: Leader | None = None
        self._seen: dict[str, tuple[Any, float]] = {}  # host file -> (its beat, when it last changed)
        self._beat = 0
        self.started = time.time()
        self._last_publish = 0.0
        self.link = LinkCheck(rendezvous())
        self._position: tuple[int, str] | None = None
        self._position_since = 0.0
        self._link_answer: Any = "unset"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdzero-stall-watch", daemon=True)

    def start(self) -> StallWatch:
        (self.records_folder / STOP_FLAG).unlink(missing_ok=True)  # an earlier stalled run's, same key
        self._thread.start()
        return self

    def set_world(self, world: int) -> None:
        self.world = world

    def output_ready(self) -> None:
        """The run holds its output folder now (sdzero.checkpoint.checkpointer.find_resume claimed it): host
        files may go there. Not before: a folder that holds anything but sdzero's mark is refused."""
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        (self.progress_dir / link_file_name(self.record.rank)).unlink(missing_ok=True)  # an earlier run's
        self.publishing = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # ---------------------------------------------------------------------------------------------- poll

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll(time.monotonic())
            except Exception as exc:  # the watcher must never take the rank down by itself
                print(f"sdzero: stall watch: {exc!r}", file=sys.stderr, flush=True)

    def poll(self, now: float) -> None:
        self.record.beat()
        if (self.records_folder / STOP_FLAG).exists():
            self._exit_stalled()
            return
        self._check_link(now)
        local = self._local()
        publisher = min((s.rank for s in local if time.time() - s.heartbeat_at < BEAT_STALE_S), default=None)
        if publisher != self.record.rank or now - self._last_publish < PUBLISH_S:
            return
        self._last_publish = now
        self._publish(local)
        if self._stall_named():
            (self.records_folder / STOP_FLAG).touch()
            return
        if self.world is not None and self._leads(local, now):
            self._lead(now)

    def _check_link(self, now: float) -> None:
        """Every rank checks its own host's way to the rendezvous once it has sat in one loop phase for
        a while (sdzero.process.link_check), and writes the answer to its link file when it changes: the
        ranks of a host may share one publisher, which cannot check another host's link for it."""
        position = (self.record.step, self.record.phase)
        if position != self._position:
            self._position, self._position_since = position, now
        idle = now - self._position_since if CODES.get(position[1], 0) >= LOOP_FROM else 0.0
        answer = self.link.update(idle, now)
        if self.publishing and answer != self._link_answer:
            self._link_answer = answer
            body = {"rank": self.record.rank, "host": socket.gethostname(), "reaches_rendezvous": answer}
            write_quick(self.progress_dir / link_file_name(self.record.rank), json.dumps(body))

    def _cut_off_hosts(self) -> set[str]:
        """Hosts with a rank of this run that last found the rendezvous out of reach."""
        hosts = set()
        for path in self.progress_dir.glob("link-*.json"):
            with contextlib.suppress(OSError, ValueError, TypeError):
                body = json.loads(path.read_text())
                if body["reaches_rendezvous"] is False and int(body["rank"]) < (self.world or 0):
                    hosts.add(str(body["host"]))
        return hosts

    def _stall_named(self) -> bool:
        """stall.json was written during this run (one left by an earlier run in the folder is not)."""
        try:
            return (self.output_dir / STALL_FILE).stat().st_mtime + 1.0 >= self.started
        except OSError:
            return False

    def _local(self) -> list[Snapshot]:
        snaps = read_host(self.records_folder)
        pids_alive = [s for s in snaps if psutil.pid_exists(s.pid)]
        return [s for s in pids_alive if self.world is None or s.rank < self.world]

    def _publish(self, local: list[Snapshot]) -> None:
        if not local or not self.publishing:
            return
        self._beat += 1
        now = time.time()
        body = {
            "host": self.record_host(local),
            "beat": self._beat,
            "written_at": now,
            "ranks": [{**snapshot_dict(s), "responding": now - s.heartbeat_at < BEAT_STALE_S} for s in local],
        }
        name = host_file_name(min(s.rank for s in local), body["host"])
        write_quick(self.progress_dir / name, json.dumps(body))

    @staticmethod
    def record_host(local: list[Snapshot]) -> str:
        return local[0].host

    def _host_files(self, below: int | None, now: float) -> list[tuple[Path, dict[str, Any], bool]]:
        """(path, content, fresh) of the host files in rank order, those whose lowest rank is under
        `below` only (None: all); a file is fresh while its beat changes within HOST_STALE_S."""
        found = []
        for path in sorted(self.progress_dir.glob("host-*.json")):
            try:
                low = int(path.name.split("-")[1])
            except (IndexError, ValueError):
                continue
            if below is not None and low >= below:
                break
            try:
                body = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            beat, changed = self._seen.get(path.name, (None, now))
            if body.get("beat") != beat:
                changed = now
            self._seen[path.name] = (body.get("beat"), changed)
            found.append((path, body, now - changed < HOST_STALE_S))
        return found

    def _leads(self, local: list[Snapshot], now: float) -> bool:
        mine = min(s.rank for s in local)
        return not any(fresh for _, _, fresh in self._host_files(mine, now))

    def _lead(self, now: float) -> None:
        assert self.world is not None
        if self.leader is None:
            self.leader = Leader(self.world)
        snaps: list[tuple[Snapshot, bool]] = []
        for _, body, fresh in self._host_files(None, now):
            for raw in body.get("ranks", []):
                raw = dict(raw)
                responding = bool(raw.pop("responding", True)) and fresh
                with contextlib.suppress(TypeError):
                    snap = Snapshot(**raw)
                    if snap.rank < self.world:
                        snaps.append((snap, responding))
        latest: dict[int, tuple[Snapshot, bool]] = {}
        for snap, responding in snaps:  # a rank in two files (its host's publisher moved): the fresher
            if snap.rank not in latest or responding:
                latest[snap.rank] = (snap, responding)
        self.leader.observe(list(latest.values()), now)
        self.leader.cut_off = self._cut_off_hosts()
        if self.stall_seconds > 0 and self.leader.stalled_for(now) > self.stall_seconds:
            self._name_stall(now)

    def _name_stall(self, now: float) -> None:
        from sdzero.atomic import write_json_atomic

        assert self.leader is not None
        lines, groups = describe_stall(self.leader.ranks, now, self.leader.cut_off)
        summary = "; ".join(lines)
        write_json_atomic(
            self.output_dir / STALL_FILE,
            {
                "detected_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "stall_seconds": self.stall_seconds,
                "exit_code": EXIT_STALLED,
                "summary": summary,
                "groups": groups,
                "ranks": [
                    {**snapshot_dict(v.snapshot), "responding": v.responding}
                    for _, v in sorted(self.leader.ranks.items())
                ],
                "flight_recorder": str(self.output_dir / FLIGHT_RECORDER_DIR) if self.nccl else None,
                "resume": "restart with --resume auto: the newest complete checkpoint",
            },
        )
        print(
            f"sdzero: stall: no rank advanced for {self.stall_seconds:g} s (--stall-seconds): {summary}; "
            f"see {self.output_dir / STALL_FILE}; exiting with {EXIT_STALLED} (restart with --resume auto)",
            file=sys.stderr,
            flush=True,
        )
        (self.records_folder / STOP_FLAG).touch()
        self._exit_stalled()

    def _exit_stalled(self) -> None:
        if self.nccl:
            dump_flight_recorder(self.output_dir / FLIGHT_RECORDER_DIR, self.record.rank)
        self.exit_fn(EXIT_STALLED)


def enable_flight_recorder(environ: dict[str, str] | Any = None) -> None:
    """Before the NCCL process group forms: torch's NCCL flight recorder keeps the last collectives of
    each rank in a ring buffer, dumped when a stall is named (it costs a few host stores per collective).
    A value the user set is kept."""
    env = os.environ if environ is None else environ
    env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def dump_flight_recorder(folder: Path, rank: int) -> Path | None:
    """This rank's NCCL flight recorder buffer (a pickle that torch's `fr_trace` tool reads), beside
    stall.json; None where torch has no recorder to dump. Only on NCCL runs (not testable on a CPU)."""
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_nccl_trace()  # type: ignore[attr-defined]
    except Exception:  # no NCCL build, or a torch without the recorder: nothing to dump
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank:05d}.pkl"
    path.write_bytes(raw)
    return path
