"""`sdzero k8s --rdma`: each pod requests the RDMA device resource and IPC_LOCK (NCCL over InfiniBand needs
both; without them it falls back to TCP), only when asked, in both flavours, schema-valid (issue 43)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.cluster.k8s import K8sJob, check_job, manifests, render
from sdzero.errors import UserError

TRAIN = [
    "--deepspeed_config",
    "/shared/ds.json",
    "--model",
    "/shared/m",
    "--data",
    "/shared/d",
    "--output-dir",
    "/shared/run",
]


def containers(job: K8sJob) -> list[dict]:
    found = []
    for doc in manifests(job):
        spec = doc.get("spec", {})
        templates = [spec.get("template")] + [
            r["template"] for r in spec.get("pytorchReplicaSpecs", {}).values()
        ]
        found += [c for t in templates if t for c in t["spec"]["containers"]]
    return found


@pytest.mark.parametrize("flavour", ["job", "pytorchjob"])
def test_rdma_adds_the_device_resource_and_ipc_lock_to_every_pod(flavour):
    job = K8sJob(nodes=2, gpus_per_node=8, train_args=TRAIN, flavour=flavour, rdma="nvidia.com/hostdev=8")
    found = containers(job)
    assert found
    for c in found:
        assert c["resources"]["limits"]["nvidia.com/hostdev"] == "8"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    one = containers(K8sJob(nodes=2, gpus_per_node=8, train_args=TRAIN, flavour=flavour, rdma="rdma/ib"))
    assert all(c["resources"]["limits"]["rdma/ib"] == "1" for c in one)


def test_without_the_option_nothing_changes():
    for c in containers(K8sJob(nodes=2, gpus_per_node=8, train_args=TRAIN)):
        assert set(c["resources"]["limits"]) == {"nvidia.com/gpu"}
        assert "securityContext" not in c


def test_the_manifests_with_rdma_validate_against_the_kubernetes_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    for doc in yaml.safe_load_all(
        render(K8sJob(nodes=2, gpus_per_node=8, train_args=TRAIN, rdma="rdma/ib=2"))
    ):
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


@pytest.mark.parametrize("bad", ["rdma ib", "rdma/ib=0", "rdma/ib=two", "/ib", "Rdma.Example/ib"])
def test_a_malformed_rdma_resource_is_refused_in_one_line(bad):
    with pytest.raises(UserError, match="--rdma"):
        check_job(K8sJob(nodes=2, gpus_per_node=8, train_args=TRAIN, rdma=bad))


def test_the_command_line_takes_rdma():
    result = CliRunner().invoke(
        app, ["k8s", "--nodes", "2", "--gpus-per-node", "8", "--rdma", "rdma/ib", *TRAIN]
    )
    assert result.exit_code == 0, result.output
    assert "rdma/ib" in result.output and "IPC_LOCK" in result.output
