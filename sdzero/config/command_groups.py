"""The options of sdzero's own commands `cache`, `slurm` and `k8s`, each declared once (type, default, help,
check); sdzero.cli generates each command from its dataclass (sdzero.config.command_options).

A slurm or k8s job (sdzero.cluster's SlurmJob, K8sJob) is these options, named as the job names them (`job_fields`),
plus the trainer's arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sdzero.config.options import INPUTS_PANEL, option, shared
from sdzero.config.train_config import check_resolution
from sdzero.errors import UserError

LAUNCH_PANEL = "Launch"


def at_least_one_pixel(pixels: int) -> int:
    if pixels < 1:
        raise UserError(f"--max-image-pixels must be at least 1, got {pixels}")
    return pixels


def resolution_check(resolution: int | None) -> int | None:
    check_resolution(resolution)  # the trainer's bound: a cache at 100000 px would exhaust memory too
    return resolution


def job_fields(options: SlurmOptions | K8sOptions, *leave_out: str) -> dict[str, Any]:
    """The options as the job's keyword arguments, each under the job's name for it."""
    names = options.JOB_NAMES
    return {names.get(k, k): v for k, v in dataclasses.asdict(options).items() if k not in leave_out}


@dataclass(frozen=True)
class CacheOptions:
    """`sdzero cache`: encode latents and text embeddings once."""

    model: str = shared("model", panel=INPUTS_PANEL)
    data: Path = shared("data", panel=INPUTS_PANEL)
    out: Path = option(help="cache folder (new, or an interrupted build of the same cache)")
    resolution: int | None = shared("resolution", check=resolution_check)
    buckets: bool = shared("buckets", note="as the trainer's --buckets")
    flip: str = option("none", "none, or both: also cache mirrored images (--random-flip)")
    dtype: str = option("bf16", "the training run's precision: bf16, fp16 or fp32")
    max_sequence_length: int | None = shared("max_sequence_length", note="SD3 only")
    shard_size: int = option(256, "samples per shard file")
    batch_size: int = option(16, "images per VAE / text-encoder call")
    max_bad_fraction: float = shared("max_bad_fraction")
    max_image_pixels: int = shared("max_image_pixels", check=at_least_one_pixel)
    num_gpus: int | None = shared("num_gpus", panel=LAUNCH_PANEL)
    hostfile: Path | None = shared("hostfile", note="every host builds its share", panel=INPUTS_PANEL)


@dataclass(frozen=True)
class SlurmOptions:
    """`sdzero slurm`: the batch script's settings (sdzero.cluster.slurm.SlurmJob less the trainer's args)."""

    JOB_NAMES: ClassVar[dict[str, str]] = {
        "gpus_per_node": "ranks_per_node",
        "rendezvous_port": "master_port",
    }

    nodes: int = shared("nodes")
    gpus_per_node: int = shared("gpus_per_node")
    time_limit: str = option("24:00:00", "Slurm time limit", flags=("--time",))
    partition: str | None = option(None, "Slurm partition")
    account: str | None = option(None, "Slurm account")
    job_name: str = option("sdzero", "Slurm job name")
    signal_lead_s: int = option(120, "seconds before the limit that Slurm warns (USR1): one step + a save")
    rendezvous_port: int = shared("rendezvous_port")
    cpus_per_task: int | None = option(None, "CPU cores per rank")
    gpus: bool = shared("gpus")


@dataclass(frozen=True)
class K8sOptions:
    """`sdzero k8s`: the manifests' settings (sdzero.cluster.k8s.K8sJob less the trainer's args), and --out."""

    JOB_NAMES: ClassVar[dict[str, str]] = {"rendezvous_port": "master_port"}

    nodes: int = shared("nodes")
    gpus_per_node: int = shared("gpus_per_node")
    image: str = option("sdzero:latest", "container image with sdzero installed")
    pvc: str = option("sdzero-shared", "ReadWriteMany PersistentVolumeClaim shared by the pods")
    pvc_size: str | None = option(None, "also write the claim, of this size (e.g. 500Gi)")
    storage_class: str | None = option(None, "storage class of a written claim")
    mount_path: str = option("/shared", "where the shared volume is mounted in each pod")
    name: str = option("sdzero", "Job and Service name (a DNS label)")
    namespace: str | None = option(None, "namespace; default: kubectl's current one")
    shm_size: str = option("16Gi", "size of /dev/shm (memory-backed emptyDir)")
    grace_period_s: int = option(600, "seconds between SIGTERM and SIGKILL: one step + a checkpoint save")
    rendezvous_port: int = shared("rendezvous_port")
    gpus: bool = shared("gpus", note="nvidia.com/gpu on Kubernetes")
    cpu: str | None = option(None, "CPU cores per pod (request = limit)")
    memory: str | None = option(None, "memory per pod, e.g. 200Gi (request = limit)")
    flavour: str = option("job", "job: Indexed Job + headless Service, no operator; pytorchjob: Kubeflow's")
    out: Path | None = option(None, "write the manifests here instead of stdout")
    rdma: str | None = option(
        None, "RDMA resource per pod, NAME[=COUNT] (e.g. rdma/ib), with IPC_LOCK for NCCL over IB"
    )
