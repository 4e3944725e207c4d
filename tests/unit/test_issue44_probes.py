"""The probes of issue #44, each as it was tried: nothing of the user's is overwritten, no read hangs, and
every bad input is one line (exit 2). Each case failed before the fix (the verdict is in docs/faults.md).

The trainer cases run `sdzero/train.py`'s own `main` in this process with launcher variables set (as under
`deepspeed`); the other commands run through their typer app or the plain function the command calls.
The signals probes are tests/unit/test_launch_signals_unit.py and tests/dist/test_launch_signals.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from launch import CONFIGS, fp32_config, write_config
from typer.testing import CliRunner

from sdzero.config.output_folder import LOCK_NAME
from sdzero.errors import EXIT_USER_ERROR, UserError

BASE = json.loads((CONFIGS / "zero2_bf16.json").read_text())


@pytest.fixture
def launched(monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


def train_main(model: Path, data: Path, config: Path, out: Path, *extra: str):
    """The trainer's main on real data, one step at most: every input but the one under test is good, so
    before the fix the run went on to the defect (trained into the folder, reached DeepSpeed, ...)."""
    from sdzero.train import main

    argv = ["--deepspeed_config", str(config), "--model", str(model), "--data", str(data), "--max-steps", "1"]
    return main([*argv, "--output-dir", str(out), *extra])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdzero: error:") and "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- data loss: the one rule


def test_an_output_dir_of_the_users_files_is_refused_and_left_as_it_was(
    tmp_path, tiny_model, synth_data, launched, capsys
):
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("ds_config.json", "run_config.json", "environment.json", "notes.txt"):
        (out / name).write_text(f"the user's {name}\n")
    before = snapshot(out)
    config = write_config(tmp_path / "ds.json", fp32_config(2))
    assert train_main(tiny_model, synth_data, config, out) == EXIT_USER_ERROR
    err = one_line(capsys)
    assert (
        f"--output-dir {out.resolve()} holds files sdzero did not write" in err
        or f"--output-dir {out} holds" in err
    )
    assert snapshot(out) == before  # not even a lock file


def test_export_final_never_replaces_a_users_final_folder(tmp_path, tiny_model, synth_data, launched, capsys):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / LOCK_NAME).write_text("")  # a run folder sdzero made
    (out / "final" / "my_pipeline.txt").write_text("keep me")
    config = write_config(tmp_path / "ds.json", fp32_config(2))
    assert train_main(tiny_model, synth_data, config, out, "--export-final") == EXIT_USER_ERROR
    assert "final is not a pipeline sdzero exported" in one_line(capsys)
    assert (out / "final" / "my_pipeline.txt").read_text() == "keep me"


def test_write_pipeline_refuses_a_folder_that_is_not_an_export(tmp_path):
    from sdzero.checkpoint.export import write_pipeline

    final = tmp_path / "final"
    final.mkdir()
    (final / "x").write_text("keep")
    with pytest.raises(UserError, match="not a pipeline sdzero exported"):
        write_pipeline(final, {}, None)  # refused before anything is built
    assert (final / "x").read_text() == "keep"


def test_the_runs_own_ds_config_is_never_an_input_so_the_lr_cannot_compound(
    tmp_path, tiny_model, synth_data, launched, capsys
):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("")
    kept = write_config(
        out / "ds_config.json", {**fp32_config(2), "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    )
    before = kept.read_bytes()
    assert train_main(tiny_model, synth_data, kept, out, "--lr-scaling", "sqrt") == EXIT_USER_ERROR
    assert "--deepspeed_config" in one_line(capsys)
    assert kept.read_bytes() == before  # 1e-4 stays 1e-4: no 1.41e-4, then 2e-4


def test_advise_and_profile_out_onto_a_users_folder_are_refused(tmp_path):
    from sdzero.config.output_lock import claim_output_dir

    out = tmp_path / "results"
    out.mkdir()
    (out / "trials.csv").write_text("the user's own table\n")
    with pytest.raises(UserError, match=r"--out .* holds files sdzero did not write \(trials.csv\)"):
        claim_output_dir(out, flag="--out")  # what advise (advisor.cli, stages.inputs) and profile call first
    assert (out / "trials.csv").read_text() == "the user's own table\n" and not (out / LOCK_NAME).exists()


def test_profile_takes_the_output_lock(tmp_path, tiny_model, synth_data):
    """`sdzero profile` rewrote trials.csv while another process held the folder: now it takes the lock
    first, and a live holder stops it before any trial or file."""
    import subprocess
    import sys

    from advisor.commands.profile import profile_command

    out = tmp_path / "profile"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from sdzero.config.output_lock import claim_output_dir as c; c(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(out)
        with pytest.raises(UserError, match="is in use by a live run"):
            profile_command(model=str(tiny_model), data=synth_data, out=out)
        assert snapshot(out) == before  # no trials.csv, no trial folder
    finally:
        holder.kill()
        holder.wait()


def test_report_out_onto_an_input_file_is_refused(tmp_path):
    from advisor.report.build import write_training_report

    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.5}\n')
    with pytest.raises(UserError, match="is not a report sdzero wrote"):
        write_training_report(run, metrics)
    assert metrics.read_text() == '{"step": 1, "loss": 0.5}\n'


def test_a_report_replaces_its_own_earlier_page(tmp_path):
    from advisor.report.build import REPORT_SIGNATURE, check_report_target

    page = tmp_path / "r.html"
    page.write_text(f"<!doctype html><html><head>{REPORT_SIGNATURE}</head></html>")
    check_report_target(page)  # no error: an earlier report is replaced


def test_export_overwrite_keeps_a_users_folder_named_like_the_old_copy(tmp_path):
    from sdzero.atomic import publish_dir

    out, tmp = tmp_path / "v1", tmp_path / "new"
    out.mkdir()
    tmp.mkdir()
    (tmp / "model").write_text("new")
    user = tmp_path / ".v1.old"  # the fixed name publish_dir once deleted first
    user.mkdir()
    (user / "precious").write_text("keep")
    publish_dir(tmp, out)
    assert (out / "model").read_text() == "new" and (user / "precious").read_text() == "keep"


@pytest.mark.parametrize("kind", ["folder", "user file", "fifo"])
def test_k8s_out_onto_a_folder_a_users_file_or_a_fifo_is_refused(tmp_path, kind):
    from sdzero.cli import app

    target = tmp_path / "manifests.yaml"
    if kind == "folder":
        target.mkdir()
    elif kind == "user file":
        target.write_text("apiVersion: v1  # the user's own\n")
    else:
        os.mkfifo(target)
    args = [
        "k8s",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--out",
        str(target),
        "--",
        "--output-dir",
        "/shared/run",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_USER_ERROR, result.output
    if kind == "user file":
        assert target.read_text() == "apiVersion: v1  # the user's own\n"
    # an earlier manifest file of sdzero's is replaced
    ok = tmp_path / "ok.yaml"
    assert CliRunner().invoke(app, [*args[:5], "--out", str(ok), *args[7:]]).exit_code == 0
    assert CliRunner().invoke(app, [*args[:5], "--out", str(ok), *args[7:]]).exit_code == 0


# ------------------------------------------------------------------------- special files and bounds


def within(seconds: float, fn) -> Any:
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


def special(tmp_path: Path, kind: str, name: str) -> Path:
    """A FIFO, or a symlink to a device node. The nodes are the test's own copies of /dev/zero and
    /dev/null (same device numbers), made in tmp_path: a writer that goes through the link (as sdzero's
    atomic writer once did, replacing /dev/null itself with a regular file) can only harm the copy."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
        return path
    node = tmp_path / f"{name}.{'zero' if kind == 'dev-zero symlink' else 'null'}-node"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 5 if kind == "dev-zero symlink" else 3))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD")
    path.symlink_to(node)
    return path


SPECIAL = ["fifo", "dev-zero symlink", "device node"]


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_deepspeed_env_is_one_line_not_a_hang(tmp_path, kind):
    from sdzero.cluster.env_file import merge_env_file

    path = special(tmp_path, kind, ".deepspeed_env")
    with pytest.raises(UserError, match=r"not a regular file") as caught:
        within(10, lambda: merge_env_file(path, {"NCCL_SOCKET_IFNAME": "eth0"}))
    assert "no such file" not in str(caught.value)


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_deepspeed_json_or_hostfile_is_named_as_what_it_is(tmp_path, kind):
    from sdzero.cluster.hostfile import parse_hostfile
    from sdzero.config.train_config import load_ds_config

    for name, read in (("ds.json", lambda p: load_ds_config(p, 1)), ("hosts", parse_hostfile)):
        path = special(tmp_path, kind, name)
        with pytest.raises(UserError, match=r"is a (FIFO|character device).*not a regular file") as caught:
            within(10, lambda p=path, r=read: r(p))
        assert "no such file" not in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--resolution", "100000"], "--resolution must be a multiple of 8 between 8 and"),
        (["--seed", str(2**70)], "--seed must be in [0, 4294967295]"),
        (["--seed", "-1"], "--seed must be in [0,"),
        (["--noise-offset", "nan"], "--noise-offset must be a finite number, got nan"),
        (["--snr-gamma", "inf"], "--snr-gamma must be a finite number"),
        (["--lr-warmup-steps", "-3"], "--lr-warmup-steps must be >= 0"),
    ],
    ids=["resolution 100000", "seed 2^70", "seed -1", "noise offset nan", "snr gamma inf", "warm-up -3"],
)
def test_bounds_on_the_options_that_decide_memory_and_numbers(
    argv, says, tmp_path, tiny_model, synth_data, launched, capsys
):
    config = write_config(tmp_path / "ds.json", fp32_config(2))
    out = tmp_path / "run"
    assert train_main(tiny_model, synth_data, config, out, *argv) == EXIT_USER_ERROR
    assert says in one_line(capsys) and not out.exists()


def test_the_cache_command_bounds_resolution_too(tmp_path, tiny_model, synth_data):
    from sdzero.cli import app

    out = tmp_path / "cache"
    args = [
        "cache",
        "--model",
        str(tiny_model),
        "--data",
        str(synth_data),
        "--out",
        str(out),
        "--resolution",
        "100000",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_USER_ERROR and "--resolution" in result.output and not out.exists()


# ------------------------------------------------------ DeepSpeed's own config check, before anything


def edited(**blocks: Any) -> dict[str, Any]:
    return {**json.loads(json.dumps(BASE)), **blocks}


BAD_DS = {
    "unknown nested key": (
        edited(zero_optimization={"stage": 2, "overlap_com": True}),
        '"zero_optimization.overlap_com": DeepSpeed has no such setting',
    ),
    "wrongly typed nested value": (
        edited(zero_optimization={"stage": 2, "reduce_bucket_size": "big"}),
        '"zero_optimization.reduce_bucket_size": DeepSpeed expects',
    ),
    "bad offload device": (
        edited(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu0"}}),
        '"zero_optimization.offload_optimizer.device"',
    ),
    "bad scheduler type": (
        edited(scheduler={"type": "WarmupLRR"}),
        '"scheduler.type" "WarmupLRR" is not a scheduler DeepSpeed knows',
    ),
    "bad scheduler params": (
        edited(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": -5}}),
        '"scheduler.params" do not build DeepSpeed\'s WarmupLR',
    ),
    "checkpoint block": (
        edited(checkpoint={"tag_validation": "Sometimes"}),
        '"checkpoint": DeepSpeed\'s config reader says',
    ),
    "checkpoint a list": (edited(checkpoint=["x"]), '"checkpoint"'),
    "gradient_clipping a string": (
        edited(gradient_clipping="1.0"),
        '"gradient_clipping" must be a finite number >= 0',
    ),
    "gradient_clipping -1": (
        edited(gradient_clipping=-1),
        '"gradient_clipping" must be a finite number >= 0',
    ),
    "monitor enabled a word": (edited(tensorboard={"enabled": "maybe"}), '"tensorboard.enabled"'),
    "JSON 100000 deep": (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested deeper than"),
    "a 5000-digit integer": (b'{"train_micro_batch_size_per_gpu": ' + b"9" * 5000 + b"}", "digits"),
    "a 30-digit integer": (edited(steps_per_print=10**30), '"steps_per_print" is an integer of 31 digits'),
}


@pytest.mark.parametrize("case", list(BAD_DS), ids=list(BAD_DS))
def test_deepspeeds_own_config_errors_come_before_any_output(
    case, tmp_path, tiny_model, synth_data, launched, capsys
):
    content, fragment = BAD_DS[case]
    config = tmp_path / "ds.json"
    config.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    out = tmp_path / "run"
    assert train_main(tiny_model, synth_data, config, out) == EXIT_USER_ERROR
    err = one_line(capsys)
    assert fragment in err and str(config) in err, err
    assert not out.exists()


def test_every_shipped_config_passes_deepspeeds_check():
    from sdzero.config.train_config import load_ds_config

    for path in sorted(CONFIGS.glob("*.json")):
        load_ds_config(path, world_size=1)


# ------------------------------------------------------------------ library errors in sdzero's words


def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    return model


def test_a_payload_in_a_text_encoder_bin_is_one_line_for_train_cache_and_export(tmp_path, tiny_model):
    from payloads import Payload

    from sdzero.models.loading import load_components

    model = model_copy(tiny_model, tmp_path)
    encoder = model / "text_encoder"
    for weights in encoder.glob("*.safetensors"):
        weights.unlink()
    marker = tmp_path / "pwned"
    import torch

    torch.save({"payload": Payload(marker)}, encoder / "pytorch_model.bin")
    with pytest.raises(UserError, match="holds a pickle the safe loader refuses") as caught:
        load_components(str(model), "fp32", "cpu")  # what train, cache and export call
    assert "\n" not in str(caught.value) and not marker.exists()


@pytest.mark.parametrize("value", [["StableDiffusionPipeline"], {"name": "StableDiffusionPipeline"}])
def test_a_class_name_that_is_a_list_or_object_is_one_line(tmp_path, tiny_model, value):
    from sdzero.models.families import detect_family

    model = model_copy(tiny_model, tmp_path)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": value}))
    with pytest.raises(UserError, match="_class_name must be a pipeline class name"):
        detect_family(str(model))


def test_a_scheduler_config_that_is_a_list_is_named_not_a_hub_error(tmp_path, tiny_model):
    from sdzero.models.loading import load_components

    model = model_copy(tiny_model, tmp_path)
    (model / "scheduler" / "scheduler_config.json").write_text("[1, 2]")
    with pytest.raises(
        UserError, match=r"scheduler/scheduler_config.json holds a JSON list, not an object"
    ) as caught:
        load_components(str(model), "fp32", "cpu")
    assert "huggingface.co" not in str(caught.value)


def test_a_unet_config_asking_for_more_memory_than_the_machine_has_is_refused_unbuilt(tmp_path, tiny_model):
    from sdzero.models.loading import load_components

    model = model_copy(tiny_model, tmp_path)
    config = json.loads((model / "unet" / "config.json").read_text())
    config["block_out_channels"] = [2**20] * len(config["block_out_channels"])
    (model / "unet" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UserError, match=r"unet/config.json asks for .* GiB in fp32\), more than this machine's"
    ):
        within(60, lambda: load_components(str(model), "fp32", "cpu"))


def test_a_non_json_build_record_is_one_line(tmp_path, tiny_model, synth_data):
    from sdzero.cli import app

    out = tmp_path / "cache"
    out.mkdir()
    (out / LOCK_NAME).write_text("")
    (out / "build.json").write_text("not json {")
    result = CliRunner().invoke(
        app, ["cache", "--model", str(tiny_model), "--data", str(synth_data), "--out", str(out)]
    )
    assert (
        result.exit_code == EXIT_USER_ERROR
        and "build.json is not JSON written by `sdzero cache`" in result.output
    )
    assert (out / "build.json").read_text() == "not json {"


class FullDiskEngine:
    """DeepSpeed's engine as the checkpointer sees it: the first save writes a shard, the second finds the
    disk full (as torch.save reports it: an OSError with ENOSPC)."""

    class checkpoint_engine:  # noqa: N801 (DeepSpeed's attribute name)
        @staticmethod
        def is_decoupled() -> bool:
            return False

    def __init__(self) -> None:
        self.saves = 0

    def save_checkpoint(self, root: str, tag: str, client_state: dict, save_latest: bool) -> None:
        self.saves += 1
        folder = Path(root) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"x" * 64)
        if self.saves > 1:
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_previous_checkpoint_stays(
    tmp_path, process_group
):
    from sdzero.checkpoint import checkpointer as ck

    ident = ck.RunIdentity(
        zero_stage=2, dtype="bf16", world_size=1, seed=0, model="m", prediction_type="epsilon"
    )
    saver = ck.Checkpointer(tmp_path / "run", 3, FullDiskEngine(), None, ident)
    saver.save(ck.TrainState(step=1))
    with pytest.raises(
        UserError, match=r"no space left on .* while saving step 2: the previous checkpoint 1 is intact"
    ):
        saver.save(ck.TrainState(step=2))
    root = ck.checkpoint_root(tmp_path / "run")
    assert [m.step for _, m in ck.complete_checkpoints(root)] == [1]
    assert not list(root.glob(f"{ck.STAGING_PREFIX}*"))  # the half save's space is given back


def test_the_atomic_writer_never_replaces_a_device_through_a_symlink(tmp_path):
    """A probe of this round's own: merging keys into a `.deepspeed_env` that was a symlink to /dev/null
    renamed a regular file over the device itself (every program's /dev/null became a file). The writer
    now refuses anything but a regular file; the node is the test's own copy."""
    from sdzero.atomic import write_text_atomic

    link = special(tmp_path, "device node", ".deepspeed_env")
    node = link.resolve()
    with pytest.raises(UserError, match="is a character device, not a regular file"):
        write_text_atomic(link, "X=1\n", follow_link=True)  # as the env file writes it
    assert stat.S_ISCHR(os.stat(node).st_mode) and link.is_symlink()


def test_checkpoints_copied_into_a_fresh_folder_are_sdzeros_own_but_a_bare_checkpoints_folder_is_not(
    tmp_path,
):
    """Resuming from a run's committed checkpoints copied into a new folder (no lock yet) is allowed: a
    checkpoint's manifest is sdzero's mark. A folder named checkpoints without one stays the user's."""
    from types import SimpleNamespace

    from sdzero.train import check_run_outputs

    def cfg(out: Path) -> SimpleNamespace:
        return SimpleNamespace(output_dir=out, export_final=False, deepspeed_config=None)

    copied = tmp_path / "copied"
    (copied / "checkpoints" / "step_00000004").mkdir(parents=True)
    (copied / "checkpoints" / "step_00000004" / "manifest.json").write_text("{}")
    check_run_outputs(cfg(copied))  # no refusal

    users = tmp_path / "users"
    (users / "checkpoints" / "step_00000004").mkdir(parents=True)
    (users / "checkpoints" / "step_00000004" / "weights.pt").write_text("mine")
    with pytest.raises(UserError, match="holds files sdzero did not write"):
        check_run_outputs(cfg(users))


def test_a_fifo_or_device_as_metadata_is_named_as_what_it_is_not_as_missing(tmp_path):
    """A FIFO named metadata.jsonl (or a link to /dev/zero) was reported as "no metadata.jsonl"."""
    from sdzero.data.images import read_metadata

    fifo_folder = tmp_path / "fifo"
    fifo_folder.mkdir()
    os.mkfifo(fifo_folder / "metadata.jsonl")
    with pytest.raises(UserError, match=r"metadata\.jsonl is a FIFO \(named pipe\), not a regular file"):
        read_metadata(fifo_folder)

    zero_folder = tmp_path / "zero"
    zero_folder.mkdir()
    (zero_folder / "metadata.jsonl").symlink_to("/dev/zero")
    with pytest.raises(UserError, match="is a character device, not a regular file"):
        read_metadata(zero_folder)
