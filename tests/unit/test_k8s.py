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

from advisor.cli import app
from sdzero.cluster.k8s import K8sJob, manifests, pod_command, render
from sdzero.errors import UserError

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


# ------------------------------------------------------------------------------- Kubeflow PyTorchJob

# The PyTorchJob envelope as the training operator's API defines it (kubeflow.org/v1: PyTorchJobSpec and
# ReplicaSpec / RunPolicy in pkg/apis/kubeflow.org/v1/{pytorch,common}_types.go, the checks of
# pytorch_validation.go), written out here because kubernetes-validate knows no CRDs. Strict like the
# Kubernetes check: a field the operator does not define is an error. The pod templates inside are checked
# against the Kubernetes schema itself (as a v1 PodTemplate).
_REPLICA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["replicas", "template"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},
    },
}
PYTORCHJOB_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            # pytorch_validation.go: the job's name is a DNS-1035 label
            "properties": {"name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "ttlSecondsAfterFinished": {"type": "integer"},
                        "activeDeadlineSeconds": {"type": "integer"},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                    },
                },
                "elasticPolicy": {"type": "object"},
                "nprocPerNode": {"type": "string", "pattern": "^(auto|cpu|gpu|[1-9][0-9]*)$"},
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,  # pytorch_validation.go: Master and Worker only
                    "required": ["Master"],
                    "properties": {
                        "Master": {
                            **_REPLICA,
                            "properties": {**_REPLICA["properties"], "replicas": {"const": 1}},
                        },
                        "Worker": _REPLICA,
                    },
                },
            },
        },
    },
}


def pytorchjob(**kw) -> dict:
    (obj,) = manifests(job(flavour="pytorchjob", **kw))
    return obj


def check_pytorchjob(obj: dict) -> None:
    import jsonschema

    jsonschema.validate(obj, PYTORCHJOB_SCHEMA)
    for kind, spec in obj["spec"]["pytorchReplicaSpecs"].items():
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": kind.lower()}}
        kubernetes_validate.validate({**pod, "template": spec["template"]}, K8S_VERSION, strict=True)
        # pytorch_validation.go: a container named "pytorch" with an image; envvar.go: MASTER_PORT is read
        # from its port named "pytorchjob-port".
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        assert container["image"] and [p["name"] for p in container["ports"]] == ["pytorchjob-port"]


@pytest.mark.parametrize("options", [{}, {"nodes": 1, "namespace": "ml", "gpus": False, "pvc_size": "1Ti"}])
def test_pytorchjob_validates_against_the_operator_api_and_the_pod_schema(options):
    objects = manifests(job(flavour="pytorchjob", **options))
    assert [o["kind"] for o in objects] == (["PersistentVolumeClaim"] if "pvc_size" in options else []) + [
        "PyTorchJob"
    ]  # the operator makes the Services
    check_pytorchjob(objects[-1])
    specs = objects[-1]["spec"]["pytorchReplicaSpecs"]
    nodes = options.get("nodes", 4)
    assert specs["Master"]["replicas"] + specs.get("Worker", {"replicas": 0})["replicas"] == nodes
    assert ("Worker" in specs) == (nodes > 1)


def test_the_pytorchjob_check_catches_a_broken_envelope():
    import jsonschema

    for damage in (
        lambda o: o["spec"]["pytorchReplicaSpecs"].update(Chief=o["spec"]["pytorchReplicaSpecs"]["Worker"]),
        lambda o: o["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),
        lambda o: o["spec"].update(runPolicy={"backoffLimits": 3}),
    ):
        broken = pytorchjob()
        damage(broken)
        with pytest.raises(jsonschema.ValidationError):
            check_pytorchjob(broken)
    broken = pytorchjob()
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriod"] = 600
    with pytest.raises(kubernetes_validate.ValidationError):
        check_pytorchjob(broken)


def test_pytorchjob_pods_keep_the_grace_period_volume_resume_and_exit_code_policy():
    obj = pytorchjob(name="sd-run", grace_period_s=900)
    for spec in obj["spec"]["pytorchReplicaSpecs"].values():
        assert spec["restartPolicy"] == "ExitCode"  # 143 (preempted, saved) restarts; 2 (bad input) fails
        pod = spec["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 900 and "subdomain" not in pod
        assert {v["name"] for v in pod["volumes"]} == {"shared", "dshm"}
        assert pod["containers"][0]["command"][-2:] == ["--resume", "auto"]
    assert obj["spec"]["nprocPerNode"] == "8"
    _, env = pod_command(job(name="sd-run", flavour="pytorchjob"))
    assert env["SDZERO_MASTER_ADDR"] == "sd-run-master-0" and env["SDZERO_INDEX_VAR"] == "RANK"


def test_entrypoint_numbers_ranks_from_the_operators_node_rank():
    # What the operator gives Worker 1 of a 3-pod PyTorchJob (envvar.go): its node rank 2 in RANK, the
    # pod count in WORLD_SIZE; no JOB_COMPLETION_INDEX. The entrypoint numbers 2 ranks per pod from it.
    command, env = pod_command(job(nodes=3, gpus_per_node=2, flavour="pytorchjob"))
    entry = command[: command.index("sdzero-pod") + 1]
    env = {**env, "PATH": os.environ["PATH"], "SDZERO_MASTER_ADDR": "localhost", "SDZERO_DNS_WAIT_S": "1"}
    env |= {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "sdzero-master-0", "MASTER_PORT": "29500"}
    rank = ["sh", "-c", 'echo "rank $RANK local $LOCAL_RANK of $WORLD_SIZE at $MASTER_ADDR"']
    done = subprocess.run([*entry, *rank], env=env, capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    ranks = sorted(line for line in done.stdout.splitlines() if line.startswith("rank"))
    assert ranks == ["rank 4 local 0 of 6 at localhost", "rank 5 local 1 of 6 at localhost"]


def test_pytorchjob_cli_and_its_bad_options(tmp_path):
    out = tmp_path / "job.yaml"
    args = ["k8s", "--nodes", "2", "--gpus-per-node", "1", "--flavour", "pytorchjob", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--", *TRAIN])
    assert result.exit_code == 0, result.output
    (obj,) = yaml.safe_load_all(out.read_text())
    check_pytorchjob(obj)
    with pytest.raises(UserError, match="--flavour 'mpijob': one of job, pytorchjob"):
        manifests(job(flavour="mpijob"))
    with pytest.raises(UserError, match="must start with a letter"):
        manifests(job(flavour="pytorchjob", name="1run"))
