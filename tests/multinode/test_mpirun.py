"""A plain `mpirun -np 2 python sdzero/train.py`: no DeepSpeed launcher, ranks found through mpi4py
(DeepSpeed's MPI discovery inside init_distributed). One host, so no root or namespaces needed."""

from __future__ import annotations

import shutil
import sys

import pytest
from cluster.launching import LOSS_RTOL, assert_same_losses, finish, losses, ok, start

from sdzero.cluster.launch_command import TRAIN_SCRIPT, free_port
from sdzero.telemetry.metrics import read_metrics

pytestmark = pytest.mark.dist


def test_mpirun_trains_like_the_deepspeed_launcher(args, reference, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (apt-get install -y openmpi-bin libopenmpi-dev)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")
    command = [
        "mpirun",
        "--oversubscribe",
        "-np",
        "2",
        "-x",
        f"MASTER_PORT={free_port()}",
        "-x",
        "TORCH_EXTENSIONS_DIR",
        sys.executable,
        str(TRAIN_SCRIPT),
        *args(tmp_path / "run"),
    ]
    output = ok(finish(start(command, tmp_path / "mpirun.log", tmp_path)))
    # No launcher set RANK/WORLD_SIZE: the two ranks found each other through mpi4py.
    assert "deepspeed.launcher" not in output
    assert {r["world_size"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")} == {2}
    assert_same_losses(losses(tmp_path / "run"), reference, LOSS_RTOL)
