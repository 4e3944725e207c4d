"""`sdzero k8s` with bad or tricky values: paths compared as the pod would walk them, no value that can
break out of its YAML scalar, every refusal one line (exit 2) with nothing written."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.cluster.k8s import K8sJob, manifests, render
from sdzero.errors import UserError

TRAIN = ["--model", "/shared/model", "--data", "/shared/data", "--output-dir", "/shared/run"]


def job(**kw) -> K8sJob:
    return K8sJob(**{"nodes": 2, "gpus_per_node": 1, "train_args": TRAIN, **kw})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"train_args": ["--output-dir", "/shared/../tmp/run"]}, "is not under the shared volume (/shared)"),
        ({"train_args": ["--output-dir", "/shared/./../etc"]}, "is not under the shared volume"),
        ({"train_args": ["--output-dir", "shared/run"]}, "is not under the shared volume"),
        ({"mount_path": "/shared\nevil: true"}, "holds a line break or control character"),
        ({"mount_path": "/shared\tx"}, "holds a line break or control character"),
        ({"mount_path": "/"}, "would hide the image's whole filesystem"),
        ({"mount_path": "/dev"}, "overlaps /dev/shm"),
        ({"image": "sdzero:1\n- evil"}, "holds a line break or control character"),
        ({"image": "my image"}, "an image reference"),
        ({"storage_class": "nfs\nx: y"}, "a storage class name"),
    ],
)
def test_bad_k8s_values_are_one_clear_line(options, message):
    with pytest.raises(UserError) as err:
        manifests(job(**options))
    assert message in str(err.value) and "\n" not in str(err.value).replace("\\n", "")


def test_mount_path_is_normalised_and_output_dir_under_it_passes():
    objects = manifests(job(mount_path="/x/../shared/", train_args=["--output-dir", "/shared/a/./run"]))
    pod = objects[-1]["spec"]["template"]["spec"]
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/shared"
    assert "at /shared\n" in render(job(mount_path="/shared/"))


def test_a_line_break_in_a_trainer_value_stays_inside_its_scalar():
    prompt = "a cat\n  evil: true\n- injected"
    args = [*TRAIN, "--validation-prompts", prompt]
    text = render(job(train_args=args))
    assert "\n  evil: true" not in text and "\n- injected" not in text  # escaped, not raw lines
    docs = list(yaml.safe_load_all(text))
    command = docs[-1]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert prompt in command  # the value itself, byte for byte


@pytest.mark.parametrize(
    "extra",
    [["--mount-path", "/shared\nx: 1"], ["--", "--output-dir", "/shared/../tmp/run"], ["--mount-path", "/"]],
)
def test_cli_exits_2_one_line_and_writes_nothing(tmp_path, extra):
    out = tmp_path / "job.yaml"
    args = ["k8s", "--nodes", "2", "--gpus-per-node", "1", "--out", str(out)]
    args += extra if extra[0] == "--" else [*extra, "--", *TRAIN]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists()
