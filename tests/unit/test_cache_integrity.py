"""A latent cache is trusted only as far as it is proven (issue #27): a shard truncated or changed after
cache.json was written is named before a run starts and rebuilt by rerunning `sdzero cache`; a killed
build's temporary files are removed by the next build; two builds into one folder cannot run at once.
Real caches built from the tiny model, real `sdzero cache` processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import fp32_config, write_config

from sdzero.config.output_lock import LOCK_NAME
from sdzero.data import cache as cache_module
from sdzero.data.cache import INDEX_NAME, file_sha256, open_cache, shard_name
from sdzero.data.cache_build import build_cache
from sdzero.errors import EXIT_USER_ERROR, UserError


@pytest.fixture(scope="module")
def good_cache(tiny_model, synth_data, tmp_path_factory) -> Path:
    """64 images in 4 shards of 16, fp32; each test damages a copy."""
    out = tmp_path_factory.mktemp("caches") / "good"
    build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=16, batch_size=16)
    return out


def copy_of(cache: Path, tmp_path: Path) -> Path:
    out = tmp_path / "cache"
    shutil.copytree(cache, out)
    return out


def open_for_run(cache: Path, tiny_model: Path, synth_data: Path):
    return open_cache(cache, str(tiny_model), synth_data, None, False, "fp32", False)


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    left, right = load_file(str(a)), load_file(str(b))
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def cache_cli(tiny_model: Path, data: Path, out: Path) -> list[str]:
    """`sdzero cache` with the options `good_cache` was built with."""
    return [
        sys.executable,
        "-m",
        "sdzero.cli",
        "cache",
        "--model",
        str(tiny_model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--dtype",
        "fp32",
        "--shard-size",
        "16",
        "--batch-size",
        "16",
    ]


def test_the_index_records_every_shards_size_and_sha256(good_cache):
    index = json.loads((good_cache / INDEX_NAME).read_text())
    for k, entry in enumerate(index["shards"]):
        path = good_cache / shard_name(k)
        assert entry["bytes"] == path.stat().st_size and entry["sha256"] == file_sha256(path)


def test_a_truncated_shard_is_named_and_the_cache_command_rebuilds_only_it(
    good_cache, tiny_model, synth_data, tmp_path
):
    cache = copy_of(good_cache, tmp_path)
    damaged = cache / shard_name(1)
    damaged.write_bytes(damaged.read_bytes()[:-100])
    with pytest.raises(UserError) as err:
        open_for_run(cache, tiny_model, synth_data)
    message = str(err.value)
    assert str(damaged) in message and "truncated" in message and "rerun the `sdzero cache" in message
    assert "\n" not in message
    untouched = {k: (cache / shard_name(k)).stat().st_mtime_ns for k in (0, 2, 3)}
    done = subprocess.run(
        cache_cli(tiny_model, synth_data, cache), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "1 built, 3 already there" in done.stdout and "rebuilding it" in done.stderr, (
        done.stdout + done.stderr
    )
    assert {k: (cache / shard_name(k)).stat().st_mtime_ns for k in (0, 2, 3)} == untouched
    assert same_tensors(cache / shard_name(1), good_cache / shard_name(1))
    assert len(open_for_run(cache, tiny_model, synth_data)) == 64


def test_a_changed_byte_of_the_same_size_is_caught_by_the_sha256(
    good_cache, tiny_model, synth_data, tmp_path, monkeypatch
):
    cache = copy_of(good_cache, tmp_path)
    damaged = cache / shard_name(2)
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor bytes: the header still parses, the size is the same
    damaged.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard-00002\.safetensors does not match its sha256 .*corrupted"):
        open_for_run(cache, tiny_model, synth_data)
    # Above FULL_CHECK_MAX_BYTES a run checks sizes only (what docs/caching.md says): this one passes...
    monkeypatch.setattr(cache_module, "FULL_CHECK_MAX_BYTES", 0)
    assert len(open_for_run(cache, tiny_model, synth_data)) == 64
    # ...and rerunning the build checks every sha256 whatever the size, and rebuilds the shard.
    result = build_cache(str(tiny_model), synth_data, cache, dtype="fp32", shard_size=16, batch_size=16)
    assert (result.built_here, result.skipped_here, result.already_complete) == (1, 3, False)
    assert same_tensors(cache / shard_name(2), good_cache / shard_name(2))


def test_the_trainer_refuses_a_damaged_cache_in_one_line_before_launch(
    good_cache, tiny_model, synth_data, tmp_path, monkeypatch, capsys
):
    from sdzero.train import main

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    cache = copy_of(good_cache, tmp_path)
    (cache / shard_name(3)).unlink()
    config = write_config(tmp_path / "ds.json", fp32_config(2))
    out = tmp_path / "run"
    argv = ["--deepspeed_config", str(config), "--model", str(tiny_model), "--data", str(synth_data)]
    code = main([*argv, "--output-dir", str(out), "--cache-dir", str(cache)])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and err.startswith("sdzero: error:") and "\n" not in err, err
    assert f"{cache / shard_name(3)} is missing" in err and not out.exists()


def test_a_killed_builds_temporary_files_are_removed_by_the_next_build(
    good_cache, tiny_model, synth_data, tmp_path
):
    cache = copy_of(good_cache, tmp_path)
    (cache / INDEX_NAME).unlink()  # as if killed before the index: the next build finishes it
    leftovers = [cache / f".{shard_name(1)}.tmp-4242", cache / f".{shard_name(3)}.tmp-99"]
    for path in leftovers:
        path.write_bytes(b"half a shard")
    result = build_cache(str(tiny_model), synth_data, cache, dtype="fp32", shard_size=16, batch_size=16)
    assert (result.built_here, result.skipped_here) == (0, 4)
    assert not any(path.exists() for path in leftovers)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [INDEX_NAME, "build.json", LOCK_NAME, *(shard_name(k) for k in range(4))]
    )


def test_a_folder_with_only_a_lock_and_leftovers_is_still_taken_as_a_new_cache(tiny_model, tmp_path):
    from sdzero.data.cache_build import _refuse_foreign

    out = tmp_path / "cache"
    out.mkdir()
    (out / LOCK_NAME).write_text("{}")
    (out / f".{shard_name(0)}.tmp-1").write_bytes(b"")
    _refuse_foreign(out)  # no refusal
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not a cache folder"):
        _refuse_foreign(out)


def wait_for_lock_of(proc: subprocess.Popen, lock: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(lock.read_text())["pid"] == proc.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, "the first build ended before it was seen holding the lock"
        time.sleep(0.005)
    raise AssertionError("the first build never took the lock")


def test_a_second_cache_build_into_the_same_folder_is_refused_while_the_first_runs(
    tiny_model, synth_data, tmp_path
):
    out = tmp_path / "cache"
    first = subprocess.Popen(
        cache_cli(tiny_model, synth_data, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_lock_of(first, out / LOCK_NAME)
        os.kill(first.pid, signal.SIGSTOP)  # frozen while it holds the lock: the race is decided
        before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        second = subprocess.run(
            cache_cli(tiny_model, synth_data, out), capture_output=True, text=True, timeout=300
        )
        errors = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == EXIT_USER_ERROR, second.stderr
        assert len(errors) == 1 and errors[0].startswith("sdzero: error: --out"), second.stderr
        assert f"is in use by a live run (host {socket.gethostname()}, pid {first.pid})" in errors[0]
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # the second wrote nothing
    finally:
        os.kill(first.pid, signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert "cached 64 samples in 4 shards" in stdout
