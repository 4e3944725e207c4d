"""Each rank's progress, readable by another process without a collective or a device sync.

Every rank keeps one fixed-size record (`RECORD_BYTES`) in a memory-mapped file in its host's shared
memory (/dev/shm): its step, its phase, the wall time it entered that phase, its pid, its host name, and a
heartbeat that the rank's watcher thread (sdzero.process.stall_watch) bumps while the process runs. The hot
loop only stores three numbers into the map per phase (no system call, no lock, no file write), framed by a
sequence number so a reader in another process never takes a half-written record for a whole one (the
seqlock pattern: odd while a write is under way, read again if it moved).

The module keeps the process's record in `_CURRENT`, so that code which has no handle on the Trainer (its
callbacks, the start-up steps) marks phases with `enter(name)`; with no record open it does nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

SHM_ROOT = Path("/dev/shm")
MAGIC = b"SDZP"
HOST_BYTES = 64
_HEAD = struct.Struct("<4sIiI64s")  # magic, record version, rank, pid, host name
_SEQ = struct.Struct("<Q")
_STATE = struct.Struct("<qid")  # step, phase code, phase entered (epoch seconds)
_BEAT = struct.Struct("<dI")  # watcher heartbeat (epoch seconds), verdict code
SEQ_AT = _HEAD.size
STATE_AT = SEQ_AT + _SEQ.size
BEAT_AT = STATE_AT + _STATE.size
RECORD_BYTES = 128
VERSION = 1
VERDICT_RUN, VERDICT_STALLED = 0, 1
"""What the host's watcher tells every rank of its host through the record: run on, or exit (a stall)."""

PHASES: tuple[str, ...] = (
    "starting",
    "process group",
    "storage checks",
    "model load",
    "data listing",
    "engine build",
    "resume",
    "data loading",
    "encode",
    "forward",
    "backward",
    "gradient reduction and optimizer",
    "step statistics",
    "checkpoint",
    "validation",
    "export",
    "callbacks",
    "straggler sharing",
    "link probe",
    "finished",
)
"""Phase names by code. The loop's phases come after "resume"; `LOOP_FROM` is the first of them."""
CODES = {name: i for i, name in enumerate(PHASES)}
LOOP_FROM = CODES["data loading"]
TIMER_PHASES = {
    "data_s": "data loading",
    "encode_s": "encode",
    "forward_s": "forward",
    "backward_s": "backward",
    "optimizer_s": "gradient reduction and optimizer",
}
"""The phase timers' names (sdzero.telemetry.phase_timers) and the progress phase each one is."""
COLLECTIVE_PHASES = frozenset(
    {
        "backward",
        "gradient reduction and optimizer",
        "step statistics",
        "checkpoint",
        "straggler sharing",
        "link probe",
    }
)
"""Phases in which a rank may be waiting in a collective for a peer (ZeRO reduces in backward and step)."""


def run_key(output_dir: Path, environ: dict[str, str] | None = None) -> str:
    """What the ranks of one run on one host agree on without talking: the output folder and the
    rendezvous address. Two runs on a host never share a key (they cannot share both)."""
    env = os.environ if environ is None else environ
    text = f"{Path(output_dir).absolute()}|{env.get('MASTER_ADDR', '')}|{env.get('MASTER_PORT', '')}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def records_dir(key: str, root: Path = SHM_ROOT) -> Path:
    return root / f"sdzero-progress-{key}"


@dataclass(frozen=True)
class Snapshot:
    """One rank's record as read by a watcher."""

    rank: int
    pid: int
    host: str
    step: int
    phase: str
    entered_at: float
    """Wall time (epoch seconds) the rank entered `phase`."""
    heartbeat_at: float
    """Wall time of the rank's watcher thread's last beat (0: no watcher yet)."""
    verdict: int

    def position(self) -> tuple[int, int, float]:
        """What changes when the rank advances: its step, its phase, and when it entered that phase."""
        return (self.step, CODES.get(self.phase, -1), self.entered_at)


class ProgressRecord:
    """This rank's record: `enter(phase)` and `set_step(step)` are plain stores into a shared map."""

    def __init__(self, folder: Path, rank: int, host: str | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank_{rank:05d}"
        self.rank = rank
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD_BYTES)
            self._map = mmap.mmap(fd, RECORD_BYTES)
        finally:
            os.close(fd)
        name = (host or socket.gethostname()).encode()[:HOST_BYTES]
        _HEAD.pack_into(self._map, 0, MAGIC, VERSION, rank, os.getpid(), name)
        self._seq = 0
        self.step = 0
        self.phase = "starting"
        self._write(CODES["starting"])

    def _write(self, code: int) -> None:
        # seqlock: an odd sequence number tells a reader that the state is being written
        self._seq += 1
        _SEQ.pack_into(self._map, SEQ_AT, self._seq)
        _STATE.pack_into(self._map, STATE_AT, self.step, code, time.time())
        self._seq += 1
        _SEQ.pack_into(self._map, SEQ_AT, self._seq)

    def enter(self, phase: str) -> None:
        self.phase = phase
        self._write(CODES[phase])

    def set_step(self, step: int) -> None:
        """The step the rank works on now (the phase stays; its next `enter` stamps the time)."""
        self.step = step

    def beat(self, verdict: int | None = None) -> None:
        """The watcher thread's heartbeat (and, from the host's watcher, a verdict for this rank)."""
        now = time.time()
        if verdict is None:
            verdict = _BEAT.unpack_from(self._map, BEAT_AT)[1]
        _BEAT.pack_into(self._map, BEAT_AT, now, verdict)

    def close(self, remove: bool = True) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()
        if remove:
            self.path.unlink(missing_ok=True)


def read_record(path: Path, tries: int = 50) -> Snapshot | None:
    """The record at `path`, or None when it is not one (yet), keeps changing under the reader, or goes
    while it is read (its run ended, or another rank's reaper removed it: several runs share a host)."""
    try:
        return _read_whole(path, tries)
    except OSError:
        return None


def _read_whole(path: Path, tries: int) -> Snapshot | None:
    raw = path.read_bytes()
    for _ in range(tries):
        if len(raw) < RECORD_BYTES:
            return None
        magic, version, rank, pid, host = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC or version != VERSION:
            return None
        seq = _SEQ.unpack_from(raw, SEQ_AT)[0]
        if seq % 2 == 0:
            step, code, entered = _STATE.unpack_from(raw, STATE_AT)
            beat, verdict = _BEAT.unpack_from(raw, BEAT_AT)
            again = path.read_bytes()
            if _SEQ.unpack_from(again, SEQ_AT)[0] == seq:
                name = PHASES[code] if 0 <= code < len(PHASES) else "unknown"
                host_name = host.rstrip(b"\0").decode(errors="replace")
                return Snapshot(rank, pid, host_name, step, name, entered, beat, verdict)
            raw = again
        else:
            time.sleep(0.0005)
            raw = path.read_bytes()
    return None


def read_host(folder: Path) -> list[Snapshot]:
    """Every readable record of this host's ranks in `folder`, by rank."""
    if not folder.is_dir():
        return []
    found = [read_record(p) for p in sorted(folder.glob("rank_*"))]
    return [s for s in found if s is not None]


def reap_stale(root: Path = SHM_ROOT, idle_s: float = 60.0) -> int:
    """Remove the records of ranks that are gone (a killed run cannot remove its own), and record folders
    left empty for `idle_s`; the records of live processes are left alone. How many records went."""
    removed = 0
    for folder in root.glob("sdzero-progress-*"):
        for path in folder.glob("rank_*"):
            snap = read_record(path)
            if snap is not None and not psutil.pid_exists(snap.pid):
                path.unlink(missing_ok=True)
                removed += 1
        with contextlib.suppress(OSError):  # not empty, or another rank just made it: kept
            if not any(folder.iterdir()) and time.time() - folder.stat().st_mtime > idle_s:
                folder.rmdir()
    return removed


# ------------------------------------------------------------------------------- the process's record

_CURRENT: ProgressRecord | None = None


def open_record(folder: Path, rank: int) -> ProgressRecord:
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = ProgressRecord(folder, rank)
    return _CURRENT


def current() -> ProgressRecord | None:
    return _CURRENT


def enter(phase: str) -> None:
    """Mark this process's phase; a no-op when no record is open (a bench's Trainer, a unit test)."""
    if _CURRENT is not None:
        _CURRENT.enter(phase)


def set_step(step: int) -> None:
    if _CURRENT is not None:
        _CURRENT.set_step(step)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Within the block the rank is in `name`; afterwards back in the phase it was in."""
    record = _CURRENT
    if record is None:
        yield
        return
    before = record.phase
    record.enter(name)
    try:
        yield
    finally:
        record.enter(before)


def close_record() -> None:
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
        _CURRENT = None
