"""`sdzero k8s`: Kubernetes manifests that train across N pods with no operator installed.

What each object is for:
- a headless Service (clusterIP None) whose name is every pod's `subdomain`: the pods of an Indexed Job are
  named `<job>-<index>`, so rank 0's pod is `<job>-0.<job>` in DNS, a stable rendezvous address that a
  restarted pod keeps. `publishNotReadyAddresses` publishes the names before any readiness probe passes;
- an Indexed Job (completionMode Indexed): N pods, each told its index in JOB_COMPLETION_INDEX, and a
  replacement pod for an index keeps it. The pod's entrypoint (POD_ENTRYPOINT) starts G ranks with
  RANK = index x G + local rank, exactly as Slurm's srun or the deepspeed launcher would number them;
- the shared volume, a ReadWriteMany PersistentVolumeClaim mounted on every pod (checkpoints, metrics,
  data), and /dev/shm as a memory-backed emptyDir: a container's default 64 MiB /dev/shm is too small for
  DataLoader workers and NCCL's shared-memory transport;
- SIGTERM is how Kubernetes preempts or drains a pod. The trainer turns it into a checkpoint at the next
  step boundary and exit 143 (sdzero/process/preemption.py), so terminationGracePeriodSeconds must cover one step
  plus a save; the podFailurePolicy then replaces such pods without counting a failure (and fails the job
  at once on exit 2, bad input), and `--resume auto` continues from the newest complete checkpoint.

`--flavour pytorchjob` writes a Kubeflow `PyTorchJob` (kubeflow.org/v1, the training operator) instead,
for clusters that run it: one Master and N-1 Workers with the same pod template. The operator makes a
Service per pod (rank 0 is `<job>-master-0`) and tells each pod its node rank in RANK (Master 0, Worker
i as i + 1), which the same entrypoint reads in place of JOB_COMPLETION_INDEX; it looks for a container
named `pytorch` and a port named `pytorchjob-port`. restartPolicy ExitCode gives the Indexed Job's failure
policy: exit codes 128-255 (143 after a preemption save, a kill) restart the pod, 1-127 (2, bad input)
fail the job.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from sdzero.cluster.slurm import output_dir_of, with_resume_auto
from sdzero.errors import UserError
from sdzero.process.preemption import EXIT_PREEMPTED

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
EXIT_BAD_INPUT = 2
CONTAINER = "trainer"
FLAVOURS = ("job", "pytorchjob")
PYTORCHJOB_CONTAINER = "pytorch"
PYTORCHJOB_PORT_NAME = "pytorchjob-port"
"""The names the training operator looks for (kubeflow.org/v1 pytorch_types.go): it injects its env into
the container so named and reads MASTER_PORT from the port so named."""
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
"""A storage class name (an object name: a DNS-1123 subdomain)."""
IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$", re.ASCII)
"""registry/name:tag@sha256:digest; no blank or control character ever belongs in one."""
SHM_PATH = "/dev/shm"
RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
"""An extended resource name (a qualified name: optional DNS-subdomain prefix, a slash, a name)."""

POD_ENTRYPOINT = r"""set -uo pipefail
# The pod's node index: set by Kubernetes for an Indexed Job's pod (JOB_COMPLETION_INDEX), by the training
# operator for a PyTorchJob's (RANK); the rest comes from the manifest's env.
index_var=${SDZERO_INDEX_VAR:-JOB_COMPLETION_INDEX}
index=${!index_var:?"not a pod of the job sdzero k8s wrote: $index_var is unset"}
export MASTER_ADDR=${SDZERO_MASTER_ADDR} MASTER_PORT=${SDZERO_MASTER_PORT}
export WORLD_SIZE=$((SDZERO_NODES * SDZERO_RANKS_PER_NODE)) LOCAL_WORLD_SIZE=${SDZERO_RANKS_PER_NODE}
# Rank 0's DNS record appears when its pod is scheduled, maybe after this one starts.
for _ in $(seq 1 "${SDZERO_DNS_WAIT_S:-300}"); do getent hosts "$MASTER_ADDR" >/dev/null && break; sleep 1; done
getent hosts "$MASTER_ADDR" >/dev/null || { echo "sdzero: $MASTER_ADDR does not resolve from $(hostname)" >&2; exit 1; }
echo "sdzero: pod $(hostname) index $index: ranks $((index * SDZERO_RANKS_PER_NODE))-$(((index + 1) * SDZERO_RANKS_PER_NODE - 1)) of $WORLD_SIZE; master $MASTER_ADDR:$MASTER_PORT"
# This shell is the container's PID 1, the process Kubernetes sends SIGTERM to: hand it to every rank,
# which checkpoints at the next step boundary and exits 143.
pids=()
trap 'echo "sdzero: SIGTERM on $(hostname): ranks checkpoint and stop"; kill -TERM "${pids[@]}" 2>/dev/null' TERM
for ((lr = 0; lr < SDZERO_RANKS_PER_NODE; lr++)); do
  RANK=$((index * SDZERO_RANKS_PER_NODE + lr)) LOCAL_RANK=$lr "$@" &
  pids+=($!)
done
code=0
for pid in "${pids[@]}"; do
  # `wait` returns early when a trapped signal arrives; keep waiting until the rank itself has ended.
  while :; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done
  [ "$code" -eq 0 ] && code=$rc
done
exit "$code"
"""


@dataclass(frozen=True)
class K8sJob:
    nodes: int
    gpus_per_node: int
    train_args: list[str]
    image: str = "sdzero:latest"
    pvc: str = "sdzero-shared"
    pvc_size: str | None = None
    """Also write the ReadWriteMany claim with this size (e.g. 500Gi); None: the claim exists already."""
    storage_class: str | None = None
    mount_path: str = "/shared"
    name: str = "sdzero"
    namespace: str | None = None
    master_port: int = 29500
    shm_size: str = "16Gi"
    grace_period_s: int = 600
    gpus: bool = True
    cpu: str | None = None
    memory: str | None = None
    backoff_limit: int = 3
    python: str = "python"
    flavour: str = "job"
    """"job": Indexed Job + headless Service, no operator; "pytorchjob": Kubeflow's PyTorchJob."""
    rdma: str | None = None
    """The RDMA device resource each pod requests, NAME or NAME=COUNT (e.g. rdma/ib, or
    nvidia.com/hostdev=8 for SR-IOV), with the IPC_LOCK capability NCCL's InfiniBand transport needs to pin
    memory; without it NCCL falls back to TCP sockets. None: neither (no RDMA devices on the cluster)."""


def rdma_request(job: K8sJob) -> tuple[str, str] | None:
    """(resource name, count) of `--rdma`, or None."""
    if job.rdma is None:
        return None
    name, _, count = job.rdma.partition("=")
    return name, count or "1"


def check_job(job: K8sJob) -> None:
    if job.flavour not in FLAVOURS:
        raise UserError(f"--flavour {job.flavour!r}: one of {', '.join(FLAVOURS)}")
    if job.flavour == "pytorchjob" and not DNS_1035_LABEL.fullmatch(job.name):
        raise UserError(
            f"--name {job.name!r}: a PyTorchJob's name must start with a letter (a DNS-1035 label)"
        )
    if job.nodes < 1:
        raise UserError(f"--nodes {job.nodes}: must be at least 1")
    if job.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {job.gpus_per_node}: must be at least 1 (ranks per pod)")
    for flag, value in (("--name", job.name), ("--pvc", job.pvc), ("--namespace", job.namespace)):
        if value is not None and not DNS_LABEL.fullmatch(value):
            raise UserError(f"{flag} {value!r}: a DNS label (lower-case letters, digits, '-'; 63 at most)")
    if len(job.name) > 50:  # pod names are <job>-<index>-<5 random>, 63 at most
        raise UserError(f"--name {job.name!r}: 50 characters at most (pod names add an index and a suffix)")
    for flag, value in (
        ("--shm-size", job.shm_size),
        ("--pvc-size", job.pvc_size),
        ("--cpu", job.cpu),
        ("--memory", job.memory),
    ):
        if value is not None and not QUANTITY.fullmatch(value):
            raise UserError(f"{flag} {value!r}: a Kubernetes quantity such as 16Gi, 500Mi or 8")
    if not 30 <= job.grace_period_s <= 86400:
        raise UserError(
            f"--grace-period-s {job.grace_period_s}: between 30 and 86400 s; it must cover one training "
            "step plus a checkpoint save, or Kubernetes kills the pod mid-save"
        )
    if not 1024 <= job.master_port <= 65535:
        raise UserError(f"--master-port {job.master_port}: must be in 1024-65535")
    for flag, value in (("--mount-path", job.mount_path), ("--image", job.image), ("python", job.python)):
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise UserError(
                f"{flag} {value!r}: holds a line break or control character, which has no place in a pod "
                "spec (it would be written into the YAML); remove it"
            )
    if not IMAGE_REF.fullmatch(job.image):
        raise UserError(f"--image {job.image!r}: an image reference such as registry/sdzero:1.0 (no blanks)")
    if job.storage_class is not None and not DNS_SUBDOMAIN.fullmatch(job.storage_class):
        raise UserError(f"--storage-class {job.storage_class!r}: a storage class name (a DNS subdomain)")
    rdma = rdma_request(job)
    if rdma is not None and (
        not RESOURCE_NAME.fullmatch(rdma[0]) or not rdma[1].isdigit() or int(rdma[1]) < 1
    ):
        raise UserError(
            f"--rdma {job.rdma!r}: an extended resource name, optionally =COUNT (e.g. rdma/ib or "
            "nvidia.com/hostdev=8), as the cluster's RDMA device plugin names it"
        )
    mount = mount_point(job)
    out = output_dir_of(job.train_args)
    # Compared as the pod's kernel would walk them: `/shared/../tmp/run` is /tmp/run, not under /shared.
    # (Symlinks on the volume cannot be seen from here; `..` and `.` can.)
    if not out.startswith("/") or not PurePosixPath(posixpath.normpath(out)).is_relative_to(mount):
        raise UserError(
            f"--output-dir {out} is not under the shared volume ({mount}): checkpoints would "
            "vanish with the pod and a restarted job could not resume; put it under --mount-path"
        )


def mount_point(job: K8sJob) -> str:
    """--mount-path normalised (`/shared/` and `/x/../shared` are /shared), refused where it cannot work."""
    if not job.mount_path.startswith("/"):
        raise UserError(f"--mount-path {job.mount_path!r}: an absolute path inside the pod")
    mount = posixpath.normpath(job.mount_path)
    if mount.startswith("//"):  # POSIX leaves a leading '//' alone; one '/' means the same path here
        mount = "/" + mount.lstrip("/")
    if mount == "/":
        raise UserError("--mount-path /: the shared volume would hide the image's whole filesystem")
    if PurePosixPath(mount).is_relative_to(SHM_PATH) or PurePosixPath(SHM_PATH).is_relative_to(mount):
        raise UserError(f"--mount-path {mount}: overlaps {SHM_PATH}, which each pod mounts as memory")
    return mount


def master_address(job: K8sJob) -> str:
    """Rank 0's pod: `<job>-0` in the headless Service's subdomain (the namespace's search path completes it);
    for a PyTorchJob, the Service the operator makes for the Master pod."""
    return f"{job.name}-master-0" if job.flavour == "pytorchjob" else f"{job.name}-0.{job.name}"


def _metadata(job: K8sJob, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {"app.kubernetes.io/name": "sdzero", "sdzero/job": job.name},
    }
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def service(job: K8sJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"sdzero/job": job.name},
            "ports": [{"name": "rendezvous", "port": job.master_port, "targetPort": job.master_port}],
        },
    }


def claim(job: K8sJob) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": job.pvc_size}},
    }
    if job.storage_class:
        spec["storageClassName"] = job.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(job, job.pvc),
        "spec": spec,
    }


def container(job: K8sJob) -> dict[str, Any]:
    limits: dict[str, str] = {"nvidia.com/gpu": str(job.gpus_per_node)} if job.gpus else {}
    requests: dict[str, str] = {}
    for key, value in (("cpu", job.cpu), ("memory", job.memory)):
        if value is not None:
            limits[key] = requests[key] = value
    rdma = rdma_request(job)
    if rdma is not None:
        limits[rdma[0]] = rdma[1]  # extended resources: the limit is the request
    env = {
        "SDZERO_NODES": str(job.nodes),
        "SDZERO_RANKS_PER_NODE": str(job.gpus_per_node),
        "SDZERO_MASTER_ADDR": master_address(job),
        "SDZERO_MASTER_PORT": str(job.master_port),
        # Downloads (a hub model) land once on the shared volume, not once per pod.
        "HF_HOME": f"{mount_point(job)}/.cache/huggingface",
        "PYTHONUNBUFFERED": "1",
    }
    pytorchjob = job.flavour == "pytorchjob"
    if pytorchjob:
        # The operator's RANK is the pod's node rank; the entrypoint reads it, then sets each rank's own.
        env["SDZERO_INDEX_VAR"] = "RANK"
    train = [job.python, "-u", "-m", "sdzero.train", *with_resume_auto(job.train_args)]
    resources: dict[str, Any] = {"limits": limits} if limits else {}
    if requests:
        resources["requests"] = requests
    spec = {
        "name": PYTORCHJOB_CONTAINER if pytorchjob else CONTAINER,
        "image": job.image,
        "command": ["bash", "-c", POD_ENTRYPOINT, "sdzero-pod", *train],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [
            {"name": PYTORCHJOB_PORT_NAME if pytorchjob else "rendezvous", "containerPort": job.master_port}
        ],
        "resources": resources,
        "volumeMounts": [
            {"name": "shared", "mountPath": mount_point(job)},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if rdma is not None:  # NCCL's IB transport registers (pins) memory: mlock beyond the default limit
        spec["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return spec


def pod_template(job: K8sJob) -> dict[str, Any]:
    """The pod both flavours run: the container, the shared volume, /dev/shm and the grace period."""
    spec = {
        "terminationGracePeriodSeconds": job.grace_period_s,
        "containers": [container(job)],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": job.pvc}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
        ],
    }
    return {"metadata": {"labels": _metadata(job, job.name)["labels"]}, "spec": spec}


def indexed_job(job: K8sJob) -> dict[str, Any]:
    template = pod_template(job)
    template["spec"] = {
        "subdomain": job.name,  # with the headless Service: <job>-<index>.<job> resolves
        "restartPolicy": "Never",  # podFailurePolicy needs it; the Job controller replaces failed pods
        **template["spec"],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(job, job.name),
        "spec": {
            "completionMode": "Indexed",
            "completions": job.nodes,
            "parallelism": job.nodes,
            "backoffLimit": job.backoff_limit,
            "podFailurePolicy": {
                "rules": [
                    # Bad input fails the same way on every retry: stop at once.
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": [EXIT_BAD_INPUT],
                        },
                    },
                    # Preempted (the trainer saved, exit 143) or evicted: replace the pod, count nothing.
                    {
                        "action": "Ignore",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": [EXIT_PREEMPTED],
                        },
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]
            },
            "template": template,
        },
    }


def pytorch_job(job: K8sJob) -> dict[str, Any]:
    """kubeflow.org/v1 PyTorchJob: one Master (rank 0's pod) and N-1 Workers, all the same pod."""

    def replicas(count: int) -> dict[str, Any]:
        # ExitCode: 128-255 (143: preempted and saved) restart the pod, 1-127 (2: bad input) fail the job.
        return {"replicas": count, "restartPolicy": "ExitCode", "template": pod_template(job)}

    specs = {"Master": replicas(1)}
    if job.nodes > 1:
        specs["Worker"] = replicas(job.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job, job.name),
        "spec": {
            "runPolicy": {"backoffLimit": job.backoff_limit},
            "nprocPerNode": str(job.gpus_per_node),
            "pytorchReplicaSpecs": specs,
        },
    }


def manifests(job: K8sJob) -> list[dict[str, Any]]:
    check_job(job)
    objects = [pytorch_job(job)] if job.flavour == "pytorchjob" else [service(job), indexed_job(job)]
    return [claim(job), *objects] if job.pvc_size else objects


class _Dumper(yaml.SafeDumper):
    """The pod entrypoint (sdzero's own text) as a `|` block, readable in the manifest; every other string
    in PyYAML's own style, which quotes and escapes a line break in a user's value (`"a\\nb"`)."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if text == POD_ENTRYPOINT else None
    ),
)


HEADER_SIGNATURE = "# Written by `sdzero k8s`"
"""The first line of every manifest file: `sdzero k8s --out` replaces only a file that starts so."""


def render(job: K8sJob) -> str:
    """The manifests as one multi-document YAML file for `kubectl apply -f`."""
    objects = manifests(job)  # checked first: the header below holds the user's values too
    header = (
        f"{HEADER_SIGNATURE}: kubectl apply -f THIS_FILE\n"
        f"# {job.nodes} pods x {job.gpus_per_node} ranks; rank 0 at {master_address(job)}:{job.master_port}; "
        f"shared volume {job.pvc} at {mount_point(job)}\n"
    )
    docs = [yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120) for obj in objects]
    return header + "---\n".join(docs)


def pod_command(job: K8sJob) -> tuple[list[str], dict[str, str]]:
    """The container's command and manifest env, as a pod runs them (tests run pods' entrypoints with it)."""
    spec = container(job)
    return list(spec["command"]), {e["name"]: e["value"] for e in spec["env"]}
