"""The namespace cluster (one per test session) and the 1-host reference run the multi-host runs match."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ckpt_helpers import exact_config
from cluster import Cluster, ClusterUnavailable, unavailable_reason
from cluster.launching import REFERENCE_STEPS, losses
from launch import check_ok, run_trainer, trainer_args, write_config


@pytest.fixture(scope="session")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no namespace cluster on this machine: {reason}")
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed (apt-get install -y pdsh); DeepSpeed starts remote ranks with it")
    try:
        with Cluster(hosts=2, slots=1) as made:
            made.write_hostfile(made.hostfile)
            yield made
    except ClusterUnavailable as exc:
        pytest.skip(f"no namespace cluster on this machine: {exc}")


@pytest.fixture(scope="session")
def exact_zero2(tmp_path_factory) -> Path:
    """fp32 ZeRO-2 with torch's AdamW: runs and resumes compare exactly (see ckpt_helpers)."""
    return write_config(tmp_path_factory.mktemp("mn-config") / "zero2_fp32.json", exact_config(2))


@pytest.fixture(scope="session")
def reference(tiny_model, synth_data, exact_zero2, tmp_path_factory) -> list[float]:
    """Losses of 1 host x 2 slots (`deepspeed --num_gpus 2`), the run every multi-host launch must match."""
    out = tmp_path_factory.mktemp("mn-reference") / "run"
    check_ok(run_trainer(exact_zero2, tiny_model, synth_data, out, steps=REFERENCE_STEPS))
    return losses(out)


@pytest.fixture(scope="session")
def args(tiny_model, synth_data, exact_zero2):
    def make(out: Path, steps: int = REFERENCE_STEPS, *extra: str) -> list[str]:
        return trainer_args(exact_zero2, tiny_model, synth_data, out, steps, *extra)

    return make
