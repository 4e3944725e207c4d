"""`sdzero k8s`: manifests valid against the Kubernetes object schema (offline), wired together (DNS names,
labels, volumes), and the pod entrypoint numbering ranks and forwarding SIGTERM as a pod would."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import yaml
from typer.testing import CliRunner

from sdzero.cli import app
from sdzero.errors import UserError
from sdzero.k8s import K8sJob, manifests, pod_command, render

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
K8S_VERSION = "1.37.0"
TRAIN = [
    "--deepspeed_config",
    "/shared/ds.json",
    "--model",
    "/shared/model",
    "--data",
    "/shared/data",
    "--output-dir",
    "/shared/run",
]


def job(**kw) -> K8sJob:
    return K8sJob(**{"nodes": 4, "gpus_per_node": 8, "train_args": TRAIN, **kw})


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pvc_size": "500Gi", "storage_class": "nfs", "namespace": "ml", "cpu": "32", "memory": "200Gi"},
        {"gpus": False},
    ],
)
def test_manifests_validate_against_the_kubernetes_schema(options):
    text = render(job(**options))
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == (["PersistentVolumeClaim"] if "pvc_size" in options else []) + [
        "Service",
        "Job",
    ]
    for doc in docs:  # strict: an unknown or misspelt field is an error too
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_broken_manifest():
    broken = by_kind(manifests(job()))["Job"]
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 600  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_indexed_job_and_headless_service_give_rank_0_a_stable_name():
    objects = by_kind(manifests(job(name="sd-run")))
    svc, spec = objects["Service"], objects["Job"]["spec"]
    pod = spec["template"]["spec"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert pod["subdomain"] == svc["metadata"]["name"] == "sd-run"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    _, env = pod_command(job(name="sd-run"))
    assert env["SDZERO_MASTER_ADDR"] == "sd-run-0.sd-run"  # <job>-<index>.<subdomain>


def test_pod_has_gpus_shared_volume_shm_grace_period_and_resumes():
    pod = by_kind(manifests(job(pvc="team-nfs", shm_size="32Gi", grace_period_s=900)))["Job"]["spec"][
        "template"
    ]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "team-nfs"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/shared", "/dev/shm"}
    assert pod["terminationGracePeriodSeconds"] == 900
    command = container["command"]
    assert command[-2:] == ["--resume", "auto"] and command[command.index("-m") + 1] == "sdzero.train"
    rules = by_kind(manifests(job()))["Job"]["spec"]["podFailurePolicy"]["rules"]
    assert {r["action"]: r for r in rules}["FailJob"]["onExitCodes"]["values"] == [2]
    assert any(r["action"] == "Ignore" and r.get("onExitCodes", {}).get("values") == [143] for r in rules)


def test_users_resume_choice_is_kept():
    command, _ = pod_command(job(train_args=[*TRAIN, "--resume", "none"]))
    assert command.count("--resume") == 1 and command[-1] == "none"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"train_args": ["--output-dir", "/tmp/run"]}, "not under the shared volume (/shared)"),
        ({"train_args": ["--data", "/shared/d"]}, "pass the trainer's --output-dir"),
        ({"name": "SD_Run"}, "--name 'SD_Run': a DNS label"),
        ({"shm_size": "lots"}, "--shm-size 'lots': a Kubernetes quantity"),
        ({"grace_period_s": 5}, "must cover one training step plus a checkpoint save"),
        ({"nodes": 0}, "--nodes 0: must be at least 1"),
    ],
)
def test_bad_options_are_one_clear_error(options, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        manifests(job(**options))


def test_cli_writes_the_file_or_exits_2(tmp_path):
    out = tmp_path / "job.yaml"
    runner = CliRunner()
    result = runner.invoke(
        app, ["k8s", "--nodes", "2", "--gpus-per-node", "1", "--no-gpus", "--out", str(out), "--", *TRAIN]
    )
    assert result.exit_code == 0, result.output
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text())] == ["Service", "Job"]
    bad = runner.invoke(app, ["k8s", "--nodes", "2", "--gpus-per-node", "1", "--", "--output-dir", "/tmp/x"])
    assert bad.exit_code == 2 and "not under the shared volume" in bad.output


def pod_env(index: int, **extra: str) -> dict[str, str]:
    _, env = pod_command(job(nodes=3, gpus_per_node=2))
    return {
        "PATH": os.environ["PATH"],
        **env,
        "SDZERO_MASTER_ADDR": "localhost",
        "SDZERO_DNS_WAIT_S": "1",
        "JOB_COMPLETION_INDEX": str(index),
        **extra,
    }


def run_pod(index: int, rank_command: list[str], **extra: str) -> subprocess.Popen:
    """The pod's container command, with the trainer swapped for `rank_command`, as Kubernetes starts it."""
    command, _ = pod_command(job(nodes=3, gpus_per_node=2))
    entry = command[: command.index("sdzero-pod") + 1]
    return subprocess.Popen(
        [*entry, *rank_command],
        env=pod_env(index, **extra),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_entrypoint_numbers_ranks_from_the_job_index():
    proc = run_pod(
        1, ["sh", "-c", 'echo "rank $RANK local $LOCAL_RANK of $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT"']
    )
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    ranks = sorted(line for line in out.splitlines() if line.startswith("rank"))
    assert ranks == ["rank 2 local 0 of 6 at localhost:29500", "rank 3 local 1 of 6 at localhost:29500"]


def test_entrypoint_hands_sigterm_to_every_rank_and_exits_with_their_code(tmp_path):
    # Each rank: note SIGTERM and exit 143, as the trainer does after its checkpoint.
    rank = f'trap "touch {tmp_path}/got.$RANK; exit 143" TERM; touch {tmp_path}/up.$RANK; while :; do sleep 0.05; done'
    proc = run_pod(0, ["bash", "-c", rank])
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("up.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what the kubelet sends to the container's PID 1
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert sorted(p.name for p in tmp_path.glob("got.*")) == ["got.0", "got.1"]
    assert "SIGTERM on" in out


def test_entrypoint_outside_an_indexed_job_says_so():
    command, env = pod_command(job())
    env = {**env, "PATH": os.environ["PATH"]}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=20)
    assert done.returncode != 0 and "JOB_COMPLETION_INDEX is unset" in done.stderr
