"""Issue #50, the write side: a link planted at any path sdzero writes is refused in one line naming it, and
nothing outside the folder is touched; a save onto a really full filesystem is one line naming the device,
with the previous checkpoint intact and no staging folder left (tests/unit/test_checkpoint_links_and_full_disk.py).

The writers are called as the commands call them; a few cases run the trainer's own `main` (in this process,
launcher variables set, as in tests/unit/test_issue44_probes.py) to show the refusal reaches the user as one
line with exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launch import CONFIGS, REPO_ROOT, fp32_config, write_config

from sdzero.errors import EXIT_USER_ERROR, UserError

VICTIM_TEXT = "the user's own file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A user's file outside the folder sdzero writes to: it must keep its bytes whatever happens."""
    path = tmp_path / "outside" / "users-file.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def plant(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def _atomic_text(p: Path) -> None:
    from sdzero.atomic import write_text_atomic

    write_text_atomic(p, "new\n")


def _atomic_json(p: Path) -> None:
    from sdzero.atomic import write_json_atomic

    write_json_atomic(p, {"a": 1})


def _atomic_csv(p: Path) -> None:
    import pandas as pd

    from sdzero.atomic import write_csv_atomic

    write_csv_atomic(pd.DataFrame({"a": [1]}), p)


def _append(p: Path) -> None:
    from sdzero.atomic import open_no_follow

    with open_no_follow(p, "a") as f:
        f.write("x\n")


def _truncate(p: Path) -> None:
    from sdzero.atomic import open_no_follow

    with open_no_follow(p, "w") as f:
        f.write("x\n")


def _metrics(p: Path) -> None:
    from sdzero.telemetry.metrics import MetricsWriter

    MetricsWriter(p).write({"step": 1})


def _rotate(p: Path) -> None:
    from sdzero.telemetry.metrics import rotate_previous

    rotate_previous(p)


def _chatter(p: Path) -> None:
    from sdzero.library_logs import ChatterLog

    ChatterLog(p).write("hello")


def _lock(p: Path) -> None:
    from sdzero.config.output_lock import claim_output_dir, release_output_dir

    try:
        claim_output_dir(p.parent)
    finally:
        release_output_dir(p.parent)


def _trial_config(p: Path) -> None:
    from advisor.measure.grid import TrialSpec, write_trial_config

    base = json.loads((CONFIGS / "zero0_bf16.json").read_text())
    spec = TrialSpec(zero_stage=0, precision="bf16", micro_batch=1, offload="none", ranks_per_node=1)
    write_trial_config(base, spec, p.parent, 1)


def _cache_shard(p: Path) -> None:
    from sdzero.data.cache_build import _write_shard

    _write_shard(p, {"x": torch.zeros(2)}, {"format": "test"})


def _cache_shard_temporary(p: Path) -> None:
    from sdzero.data.cache_build import _tmp_name, _write_shard

    final = p.with_name("shard-00000.safetensors")
    assert _tmp_name(final) == p
    _write_shard(final, {"x": torch.zeros(2)}, {"format": "test"})


def _publish(p: Path) -> None:
    from sdzero.atomic import publish_dir

    tmp = p.parent / ".tmp-new"
    tmp.mkdir()
    publish_dir(tmp, p)


def _new_dir(p: Path) -> None:
    from sdzero.atomic import new_dir

    with new_dir(p) as tmp:
        (tmp / "x").write_text("x")


def _remove_tree(p: Path) -> None:
    from sdzero.atomic import remove_tree

    remove_tree(p)


# (writer, the name it writes in its folder, whether the planted link points at a folder)
WRITERS: dict[str, tuple[Callable[[Path], None], str, bool]] = {
    "atomic text (LATEST, reports, recommended_ds_config.json)": (_atomic_text, "latest", False),
    "atomic json (environment.json, plan_inputs.json)": (_atomic_json, "recommended_ds_config.json", False),
    "atomic csv (trials.csv, validation.csv)": (_atomic_csv, "trials.csv", False),
    "append (a log)": (_append, "log.txt", False),
    "truncate (a launch's log.txt)": (_truncate, "log.txt", False),
    "metrics.jsonl": (_metrics, "metrics.jsonl", False),
    "metrics.jsonl rotation": (_rotate, "metrics.jsonl", False),
    "library chatter log": (_chatter, "library.log", False),
    ".sdzero.lock": (_lock, ".sdzero.lock", False),
    "a trial's ds_config.json": (_trial_config, "ds_config.json", False),
    "a cache shard": (_cache_shard, "shard-00000.safetensors", False),
    "a cache shard's temporary": (
        _cache_shard_temporary,
        f".shard-00000.safetensors.tmp-{os.getpid()}",
        False,
    ),
    "a published folder (export)": (_publish, "final", True),
    "a new folder (tiny model, synthetic data)": (_new_dir, "tiny", True),
    "a removed folder (universal conversion, storage probe)": (_remove_tree, "probe", True),
}


@pytest.mark.parametrize("case", list(WRITERS), ids=list(WRITERS))
def test_every_writer_refuses_a_link_planted_where_it_writes(tmp_path, victim, case):
    write, name, folder = WRITERS[case]
    target = victim.parent if folder else victim
    link = plant(tmp_path / "run" / name, target)
    before = sorted(p.name for p in victim.parent.iterdir())
    with pytest.raises(UserError, match=rf"{link} is a symbolic link \(to {target}\).*nothing was written"):
        write(link)
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in victim.parent.iterdir()) == before
    assert link.is_symlink()  # named, not removed: the user sees what was planted


def test_a_users_own_env_file_link_is_still_written_through(tmp_path):
    """The one writer allowed to follow a link: the user's `.deepspeed_env`, a file they named themselves
    (a dotfile kept in a repository and linked into place)."""
    from sdzero.cluster.env_file import merge_env_file

    real = tmp_path / "dotfiles" / "deepspeed_env"
    real.parent.mkdir()
    real.write_text("A=1\n")
    link = plant(tmp_path / ".deepspeed_env", real)
    merge_env_file(link, {"B": "2"})
    assert link.is_symlink() and real.read_text() == "A=1\nB=2\n"


# ------------------------------------------------------------------------- the trainer, as the user runs it


@pytest.fixture
def launched(monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)


def test_the_trainer_refuses_a_planted_lock_in_one_line(
    tmp_path, tiny_model, synth_data, launched, capsys, victim
):
    """The lock is taken before any process group or model exists: the trainer's own `main`, in this process."""
    from sdzero.train import main

    out = tmp_path / "run"
    out.mkdir()
    link = plant(out / ".sdzero.lock", victim)
    config = write_config(tmp_path / "ds.json", fp32_config(0, micro=1))
    argv = ["--deepspeed_config", str(config), "--model", str(tiny_model), "--data", str(synth_data)]
    code = main([*argv, "--max-steps", "1", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_USER_ERROR and f"{link} is a symbolic link" in err, err
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink()


def test_a_real_run_refuses_a_planted_ds_config_json_and_writes_nothing_outside(
    tmp_path, tiny_model, synth_data, victim
):
    """ds_config.json is written once the run has its process group and model: a real trainer process (as
    the launcher starts it), not this one, so no process group of another test is in its way."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".sdzero.lock").write_text("")  # an earlier run's folder: sdzero's own, so written into
    link = plant(out / "ds_config.json", victim)
    config = write_config(tmp_path / "ds.json", fp32_config(0, micro=1))
    argv = ["--deepspeed_config", str(config), "--model", str(tiny_model), "--data", str(synth_data)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "sdzero" / "train.py"),
            *argv,
            "--max-steps",
            "1",
            "--num-workers",
            "0",
            "--output-dir",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert (
        done.returncode == EXIT_USER_ERROR
        and last.startswith("sdzero: error: ")
        and f"{link} is a symbolic link" in last
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink()


def test_advise_out_refuses_a_planted_lock(tmp_path, victim):
    from sdzero.config.output_folder import LOCK_NAME
    from sdzero.config.output_lock import claim_output_dir

    out = tmp_path / "advise"
    out.mkdir()
    (out / "plan_inputs.json").write_text("{}")
    link = plant(out / LOCK_NAME, victim)
    with pytest.raises(UserError, match=f"{link} is a symbolic link"):
        claim_output_dir(out, "--out")
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("subfolder", ["trials", "comm", "trials/launch-1"])
def test_a_link_planted_at_a_subfolder_of_a_locked_folder_is_refused(tmp_path: Path, subfolder: str) -> None:
    """An advise folder's `trials/` or `comm/` planted as a link to another folder: writing a file below it
    would rename into that other folder. Refused naming the link; the other folder stays empty."""
    from sdzero.atomic import write_json_atomic
    from sdzero.config.safe_write import open_no_follow

    out = tmp_path / "advise-out"
    out.mkdir()
    (out / ".sdzero.lock").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = plant(out / subfolder, elsewhere)
    with pytest.raises(UserError, match=f"{link} is a symbolic link"):
        write_json_atomic(link / "trials.json", {"a": 1})
    with pytest.raises(UserError, match="is a symbolic link"):
        open_no_follow(link / "launch.log", "a")
    assert list(elsewhere.iterdir()) == []


def test_links_above_the_locked_folder_are_the_users_layout_and_followed(tmp_path: Path) -> None:
    """/shared -> /mnt/nfs above the run folder is the user's own layout: writes below it go on."""
    from sdzero.atomic import write_json_atomic

    real = tmp_path / "mnt-nfs"
    (real / "runs" / "first").mkdir(parents=True)
    (real / "runs" / "first" / ".sdzero.lock").write_text("")
    shared = plant(tmp_path / "shared", real)
    write_json_atomic(shared / "runs" / "first" / "trials" / "x.json", {"a": 1})
    assert json.loads((real / "runs" / "first" / "trials" / "x.json").read_text()) == {"a": 1}
