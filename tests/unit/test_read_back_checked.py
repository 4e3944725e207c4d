"""Issue #50, the read side: every file sdzero reads back from an earlier folder (plan and launch records, link
fits, trials and validation tables, metrics, run and profile files) goes through the regular-file reader
(sdzero.config.user_file): a FIFO, a device, a link loop or an oversized file is named as what it is, in one
line, at once; and link fits that cannot be read are an error, never the same answer as "not measured"."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdzero.errors import UserError

KINDS = {
    "fifo": "is a FIFO (named pipe)",
    "dev-zero link": "is a character device",
    "link loop": "Too many levels of symbolic links",
    "folder": "is a folder",
}


def special(path: Path, kind: str) -> Path:
    """A FIFO, a link to a copy of /dev/zero (made here: nothing of the machine's is touched), a link that
    points at itself, or a folder, at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero link":
        node = path.with_name(path.name + ".zero-node")
        try:
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("making a device node needs CAP_MKNOD (root)")
        path.symlink_to(node)
    elif kind == "link loop":
        path.symlink_to(path.name)
    else:
        path.mkdir()
    return path


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run `fn` in a thread; fail (not hang) if it has not returned in `seconds`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed back to the test)
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked (before: for ever)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def refused(fn: Callable[[], Any], words: str) -> str:
    with pytest.raises(UserError) as error:
        within(20, fn)
    line = str(error.value)
    assert words in line and "\n" not in line, line
    return line


def _plan_inputs(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.stages.replan import PLAN_INPUTS, read_plan_inputs

    special(folder / PLAN_INPUTS, kind)
    return lambda: read_plan_inputs(folder)


def _launches(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.measure.launch import read_launches

    special(folder / "launches.json", kind)
    return lambda: read_launches(folder / "launches.json")


def _fits(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.model.network import build_network

    special(folder / "comm" / "comm_fit.json", kind)
    return lambda: build_network(folder / "comm" / "comm_fit.json", 8)


def _trials(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.measure.csv_tables import read_table

    special(folder / "trials.csv", kind)
    return lambda: read_table(folder / "trials.csv", "--replan")


def _trial_table(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.measure.csv_tables import read_whole_rows

    special(folder / "trials.csv", kind)
    return lambda: read_whole_rows(folder / "trials.csv")


def _trial_profile(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.measure.trials import read_profile

    special(folder / "profile.json", kind)
    return lambda: read_profile(folder / "profile.json")


def _metrics(folder: Path, kind: str) -> Callable[[], Any]:
    from sdzero.telemetry.metrics import read_metric_lines

    special(folder / "metrics.jsonl", kind)
    return lambda: read_metric_lines(folder / "metrics.jsonl", "--run")


def _report_metrics(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.report.train_page import read_segment

    special(folder / "metrics.jsonl", kind)
    return lambda: read_segment(folder / "metrics.jsonl")


def _run_record(folder: Path, kind: str) -> Callable[[], Any]:
    from advisor.report.page import read_json_object

    special(folder / "run_config.json", kind)
    return lambda: read_json_object(folder / "run_config.json")


READERS = {
    "plan_inputs.json": _plan_inputs,
    "launches.json": _launches,
    "comm_fit.json": _fits,
    "trials.csv (replan)": _trials,
    "trials.csv (resume)": _trial_table,
    "a trial's profile.json": _trial_profile,
    "metrics.jsonl (replan)": _metrics,
    "metrics.jsonl (report)": _report_metrics,
    "run_config.json (report)": _run_record,
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("reader", list(READERS))
def test_every_read_back_names_what_is_there(tmp_path, reader, kind):
    refused(READERS[reader](tmp_path / "earlier", kind), KINDS[kind])


def test_an_oversized_plan_record_is_one_line(tmp_path):
    from advisor.stages.replan import PLAN_INPUTS, read_plan_inputs
    from sdzero.config.user_file import MAX_TEXT_BYTES

    path = tmp_path / PLAN_INPUTS
    with open(path, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)  # sparse: no disk used
    refused(lambda: read_plan_inputs(tmp_path), "bytes, more than the")


@pytest.mark.parametrize(
    "text, words",
    [
        ("not json", "not JSON"),
        ('{"schema": "something else", "fits": []}', "not a comm_fit.json this version reads"),
        ('{"schema": "%s", "fits": [{"no": "fields"}]}', "a fit without its fields"),
    ],
)
def test_link_fits_that_cannot_be_read_are_an_error_not_dropped(tmp_path, text, words):
    """Before: a fits file that was not a regular file was skipped as if the link had not been measured,
    and the plan changed without a word."""
    from advisor.measure.alphabeta import FIT_SCHEMA
    from advisor.model.network import build_network

    path = tmp_path / "comm_fit.json"
    path.write_text(text.replace("%s", FIT_SCHEMA))
    refused(lambda: build_network(path, 8), words)


def test_a_torn_launch_record_still_reads_as_none(tmp_path):
    """A record cut short by a kill (an older version wrote it in place) stays what it was: no launches."""
    from advisor.measure.launch import read_launches

    path = tmp_path / "launches.json"
    path.write_text(json.dumps({"setup": "s", "launches": []})[:-5])
    assert read_launches(path) == []


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", ["input.json", "profile/z1/profile.json"])
def test_the_input_figures_read_back_name_what_is_there(tmp_path: Path, kind: str, where: str) -> None:
    """The input measurements a replan reads back (issue #49's input.json, a launch's profile.json) go
    through the same reader: a FIFO there was a hang, a link to /dev/zero a read without end."""
    from advisor.measure.input_figures import launch_input_sections

    special(tmp_path / where, kind)
    if where.startswith("profile/") and kind == "link loop":
        assert within(20, lambda: launch_input_sections(tmp_path)) == []  # the search never lists it
        return
    refused(lambda: launch_input_sections(tmp_path), KINDS[kind])
