"""The rank's progress record (sdzero.telemetry.progress) read from another process, and the stall
watch's naming (sdzero.process.stall_watch) on records written by hand: who holds the job, the line, the
exit code, and no stall named before the loop, after a rank finished, or before --stall-seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdzero.process.stall_exit import StallCheck, output_dir_of
from sdzero.process.stall_watch import (
    EXIT_STALLED,
    STALL_FILE,
    STOP_FLAG,
    Leader,
    RankView,
    StallWatch,
    describe_stall,
    rank_ranges,
)
from sdzero.telemetry.progress import SEQ_AT, ProgressRecord, Snapshot, read_host, read_record


def test_a_record_is_read_whole_by_another_process(tmp_path):
    record = ProgressRecord(tmp_path, 3, host="nodeA")
    record.set_step(1200)
    record.enter("data loading")
    code = (
        "import sys; from pathlib import Path; from sdzero.telemetry.progress import read_record; "
        "s = read_record(Path(sys.argv[1])); print(s.rank, s.host, s.step, s.phase)"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code, str(record.path)], capture_output=True, text=True, check=True
    )
    assert shown.stdout.split() == ["3", "nodeA", "1200", "data", "loading"]
    record.close()
    assert not record.path.exists()


def test_a_record_being_written_is_not_taken_for_a_whole_one(tmp_path):
    record = ProgressRecord(tmp_path, 0, host="h")
    record.enter("forward")
    raw = bytearray(record.path.read_bytes())
    raw[SEQ_AT] |= 1  # an odd sequence number: a write under way
    torn = tmp_path / "torn"
    torn.write_bytes(bytes(raw))
    assert read_record(torn, tries=3) is None
    assert read_record(record.path).phase == "forward"


def test_a_record_that_goes_while_it_is_read_is_none(tmp_path, monkeypatch):
    """Another run's record removed between two reads (its rank ended, or a reaper took it) is no record,
    not an error: the stale reaper of a starting rank reads every run's records on the host."""
    record = ProgressRecord(tmp_path, 1, host="h")
    record.enter("forward")
    raw = bytearray(record.path.read_bytes())
    raw[SEQ_AT] |= 1  # mid-write: the reader reads the file again
    going = tmp_path / "going"
    going.write_bytes(bytes(raw))
    first_read = Path.read_bytes

    def read_then_remove(path: Path) -> bytes:
        data = first_read(path)
        path.unlink()
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_remove)
    assert read_record(going) is None


def snap(rank: int, host: str, step: int, phase: str, entered: float = 0.0) -> Snapshot:
    return Snapshot(rank, 100 + rank, host, step, phase, entered, time.time(), 0)


def test_the_stopped_rank_is_named_first_and_the_others_wait():
    views = {
        r: RankView(snap(r, "node3" if r == 5 else "node1", 1200, "backward"), changed_at=0.0)
        for r in range(16)
    }
    views[5] = RankView(snap(5, "node3", 1200, "data loading"), changed_at=0.0, responding=False)
    lines, groups = describe_stall(views, now=95.0)
    assert lines == [
        "rank 5 (node3) in data loading at step 1,200 for 95 s (not responding)",
        "ranks 0-4, 6-15 (node1) waiting in backward at step 1,200",
    ]
    assert groups[0]["holding_the_job"] and groups[0]["ranks"] == [5]


def test_with_every_rank_responding_the_one_behind_holds_the_job():
    views = {r: RankView(snap(r, "a", 7, "gradient reduction and optimizer"), 0.0) for r in range(3)}
    views[1] = RankView(snap(1, "b", 7, "data loading"), 0.0)
    lines, _ = describe_stall(views, now=40.0)
    assert lines[0] == "rank 1 (b) in data loading at step 7 for 40 s"
    assert lines[1] == "ranks 0, 2 (a) waiting in gradient reduction and optimizer at step 7"


def test_all_ranks_in_one_place_is_one_line():
    views = {r: RankView(snap(r, "a", 9, "checkpoint"), 0.0) for r in range(2)}
    assert describe_stall(views, now=301.0)[0] == ["ranks 0-1 (a) in checkpoint at step 9 for 301 s"]


def test_rank_ranges():
    assert rank_ranges([0, 1, 2, 4, 6, 7]) == "0-2, 4, 6-7"
    assert rank_ranges([5]) == "5"


def test_no_stall_before_every_rank_is_in_the_loop_nor_after_one_finished():
    leader = Leader(world=2)
    leader.observe([(snap(0, "a", 0, "engine build"), True), (snap(1, "a", 1, "forward"), True)], now=0.0)
    assert leader.stalled_for(1000.0) == 0.0  # rank 0 still starting: start-up is not a stall here
    leader.observe([(snap(0, "a", 1, "forward", 1.0), True), (snap(1, "a", 1, "forward"), True)], now=10.0)
    assert leader.stalled_for(50.0) == 40.0
    leader.observe([(snap(0, "a", 9, "finished", 2.0), True), (snap(1, "a", 1, "forward"), True)], now=60.0)
    assert leader.stalled_for(1000.0) == 0.0


class Exited(Exception):
    pass


def watch_of(record: ProgressRecord, shm: Path, out: Path, stall_s: float) -> StallWatch:
    def exit_fn(code: int) -> None:
        raise Exited(code)

    watch = StallWatch(record, shm, out, stall_s, exit_fn=exit_fn)
    watch.set_world(2)
    watch.output_ready()
    return watch


def test_the_watch_names_a_stall_writes_stall_json_and_exits_142(tmp_path, capsys):
    shm, out = tmp_path / "shm", tmp_path / "out"
    mine = ProgressRecord(shm, 0, host="n1")
    other = ProgressRecord(shm, 1, host="n1")
    mine.set_step(4)
    mine.enter("backward")
    other.set_step(4)
    other.enter("data loading")
    watch = watch_of(mine, shm, out, stall_s=30)
    watch.poll(now=100.0)  # publishes host-00000-n1.json, leads, sees both ranks in the loop
    other.beat()
    watch.poll(now=120.0)
    assert not (out / STALL_FILE).exists()  # 20 s without progress: under --stall-seconds
    other.beat()
    with pytest.raises(Exited) as ended:
        watch.poll(now=131.5)
    assert ended.value.args == (EXIT_STALLED,)
    stall = json.loads((out / STALL_FILE).read_text())
    assert stall["summary"] == (
        "rank 1 (n1) in data loading at step 4 for 32 s; rank 0 (n1) waiting in backward at step 4"
    )
    assert (shm / STOP_FLAG).exists()  # the host's other ranks exit at their next poll
    assert stall["summary"] in capsys.readouterr().err
    mine.close()
    other.close()


def test_a_launch_names_the_code_only_for_a_stall_of_this_run(tmp_path):
    assert output_dir_of(["--model", "m", "--output-dir", "o"]) == Path("o")
    assert output_dir_of(["--output_dir=x"]) == Path("x") and output_dir_of(["--data", "d"]) is None
    (tmp_path / STALL_FILE).write_text("{}")
    assert not StallCheck(tmp_path, started=time.time() + 60).named()  # an earlier run's file
    check = StallCheck(tmp_path, started=time.time() - 1)
    assert check.named() and not check.overdue() and check.report() == EXIT_STALLED


def test_read_host_skips_what_is_not_a_record(tmp_path):
    ProgressRecord(tmp_path, 2, host="h").enter("forward")
    (tmp_path / "rank_junk").write_bytes(b"x" * 10)
    assert [s.rank for s in read_host(tmp_path)] == [2]


def test_a_rank_dies_with_a_launcher_only():
    from sdzero.process.orphan_guard import is_launcher

    assert is_launcher(["/venv/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"])
    assert is_launcher(["/usr/bin/orted", "-mca", "ess", "env"]) and is_launcher(["slurmstepd: [7.0]"])
    assert not is_launcher(["/bin/bash"]) and not is_launcher(["/home/sorted/python", "x.py"])


def test_records_of_gone_processes_are_reaped_and_live_ones_kept(tmp_path):
    from sdzero.telemetry.progress import reap_stale

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    old, live = tmp_path / "sdzero-progress-old", tmp_path / "sdzero-progress-live"
    ProgressRecord(old, 0, host="h")
    raw = bytearray((old / "rank_00000").read_bytes())
    raw[12:16] = int(dead.stdout).to_bytes(4, "little")  # the pid field of a process that has exited
    (old / "rank_00000").write_bytes(bytes(raw))
    ProgressRecord(live, 1, host="h")
    assert reap_stale(tmp_path, idle_s=0) == 1
    assert not old.exists() and (live / "rank_00001").exists()
