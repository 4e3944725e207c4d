"""The one-line probes of issue #50, each as it was tried: every one failed before its fix (a NaN loss with exit
0, a traceback, a manifest that does not parse, a check made on the wrong folder, a wait of minutes, a
million lines). The write, read-back and schema probes are in test_no_write_through_links.py,
test_checkpoint_links_and_full_disk.py, test_read_back_checked.py and test_input_schema.py."""

from __future__ import annotations

import logging
import os
import time

import pytest
from launch import fp32_config, write_config
from typer.testing import CliRunner

from sdzero.errors import EXIT_USER_ERROR, UserError


@pytest.fixture
def launched(monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)


def test_a_noise_offset_of_1e308_is_refused_before_it_trains_a_nan_loss(
    tmp_path, tiny_model, synth_data, launched, capsys
):
    from sdzero.train import main

    config = write_config(tmp_path / "ds.json", fp32_config(2))
    out = tmp_path / "run"
    argv = ["--deepspeed_config", str(config), "--model", str(tiny_model), "--data", str(synth_data)]
    code = main([*argv, "--max-steps", "1", "--output-dir", str(out), "--noise-offset", "1e308"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and "--noise-offset must be in [0, 1.0], got 1e+308" in err, err
    assert "\n" not in err and not out.exists()


@pytest.mark.parametrize("command", ["advise", "profile"])
def test_an_unbalanced_quote_in_train_args_is_one_line(tmp_path, command):
    from advisor.cli import app

    args = [command, "--model", "m", "--data", str(tmp_path), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, [*args, "--train-args", "--validation-prompts 'a cat"])
    assert result.exit_code == EXIT_USER_ERROR, result.output
    assert "No closing quotation (an unbalanced quote?)" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


TRAIN = ["--model", "/shared/model", "--data", "/shared/data", "--output-dir", "/shared/run"]


@pytest.mark.parametrize(
    "field",
    ["name", "namespace", "pvc", "shm_size", "pvc_size", "cpu", "memory", "storage_class", "image"],
)
def test_a_k8s_value_ending_in_a_newline_is_refused(field):
    """`$` matches before a final newline: `--cpu '8\\n'` passed the check and gave a manifest that does not
    parse as the user meant."""
    from sdzero.cluster.k8s import K8sJob, manifests

    good = {"name": "run", "namespace": "ml", "pvc": "data", "shm_size": "16Gi", "pvc_size": "100Gi"}
    good |= {"cpu": "8", "memory": "64Gi", "storage_class": "nfs", "image": "registry/sdzero:1"}
    job = K8sJob(nodes=2, gpus_per_node=1, train_args=TRAIN, **good)
    manifests(job)  # the good values pass
    bad = K8sJob(**{**job.__dict__, field: good[field] + "\n"})
    with pytest.raises(UserError) as refused:
        manifests(bad)
    assert "\n" not in str(refused.value).replace("\\n", "")


@pytest.mark.parametrize("field, value", [("time_limit", "24:00:00\n"), ("job_name", "sdzero\n")])
def test_a_slurm_value_ending_in_a_newline_is_refused(field, value):
    from sdzero.cluster.slurm import SlurmJob, render

    with pytest.raises(UserError):
        render(SlurmJob(nodes=2, ranks_per_node=1, train_args=TRAIN, **{field: value}))


def test_the_last_output_dir_is_the_one_k8s_checks_against_the_shared_volume():
    """The trainer takes the last --output-dir; the check once took the first, so a second one outside the
    shared volume got past it and the pods wrote to their own disks."""
    from sdzero.cluster.k8s import K8sJob, manifests

    job = K8sJob(nodes=2, gpus_per_node=1, train_args=[*TRAIN, "--output-dir", "/tmp/elsewhere"])
    with pytest.raises(UserError, match=r"--output-dir /tmp/elsewhere is not under the shared volume"):
        manifests(job)


def test_the_last_output_dir_is_the_one_the_slurm_script_guards():
    from sdzero.cluster.slurm import SlurmJob, output_dir_of, render

    args = [*TRAIN, "--output-dir=/scratch/second"]
    assert output_dir_of(args) == "/scratch/second"
    script = render(SlurmJob(nodes=2, ranks_per_node=1, train_args=args))
    assert "OUT=/scratch/second\n" in script and "OUT=/shared/run" not in script


def test_doctor_names_a_host_that_never_answers_after_a_bounded_wait(tmp_path, monkeypatch):
    """Before: a TimeoutExpired traceback after 123 s. The host is an `ssh` on PATH that never returns."""
    from sdzero.cluster import doctor

    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    start = time.monotonic()
    with pytest.raises(UserError) as refused:
        doctor._remote("node-that-never-answers", ["node"], timeout_s=1)
    assert time.monotonic() - start < 30
    line = str(refused.value)
    assert line.startswith("node-that-never-answers: `sdzero.cluster.doctor node` gave no answer in 1 s")
    assert "\n" not in line


def test_a_metrics_line_nested_100000_deep_is_named_by_the_report(tmp_path):
    from advisor.report.train_page import read_segment

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 0.5, "samples_per_s": 8.0, "step_time_s": 0.5}\n' + "[" * 100_000 + "\n"
    )
    with pytest.raises(UserError, match=r"metrics.jsonl:2: nested too deep to read"):
        read_segment(path)


def test_a_million_missing_images_print_a_bounded_number_of_lines_and_a_count(tmp_path, caplog, monkeypatch):
    """Every record names a file that is not there; before, one warning line per file. 20,000 stand for the
    million: the number of lines no longer grows with them."""
    from types import SimpleNamespace

    from sdzero.data import listing
    from sdzero.data.images import LISTED_UNREADABLE, Record

    monkeypatch.setenv("SDZERO_LISTING_DIR", str(tmp_path / "listings"))
    n = 20_000
    records = [Record(tmp_path / "images" / f"{i}.png", "a cat") for i in range(n)]
    one = SimpleNamespace(rank=0, world=1, broadcast=lambda obj: obj, gather=lambda obj: [obj])
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(UserError, match=f"{n} of {n} images are unreadable"),
    ):
        listing.check_images(records, tmp_path / "images", one, 0.5)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == LISTED_UNREADABLE + 1
    assert lines[-1] == f"... and {n - LISTED_UNREADABLE} more unreadable images, not listed ({n} in all)"


def test_the_k8s_command_refuses_a_newline_value_in_one_line(tmp_path):
    from advisor.cli import app

    result = CliRunner().invoke(
        app,
        [
            "k8s",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--cpu",
            "8\n",
            "--out",
            str(tmp_path / "job.yaml"),
            "--",
            *TRAIN,
        ],
    )
    assert result.exit_code == EXIT_USER_ERROR and "--cpu" in result.output, result.output
    assert not (tmp_path / "job.yaml").exists()
