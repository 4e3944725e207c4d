"""The rendezvous sdzero sets up itself: a free port, and a world of one for a process no launcher started.

Light on purpose (no torch): the trainer's entry point calls `world_of_one` before anything else.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping


def free_port() -> int:
    """A port nobody listens on now (tests and the demo run side by side with other jobs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMI_RANK",
    "PMIX_RANK",
)
"""What a launcher leaves in each rank's environment: deepspeed, torchrun and sdzero's Slurm wrapper
(RANK, WORLD_SIZE, LOCAL_RANK), Open MPI, MPICH / Intel MPI and PMIx (read by DeepSpeed's MPI discovery)."""


SINGLE_RANK_NOTICE = (
    "sdzero: no launcher (deepspeed, torchrun, mpirun) started this process: running as one rank, a "
    "world of one"
)
_made_here: list[bool] = []
"""Set once world_of_one gave this process its world (the notice is printed when the group forms)."""


def made_world_of_one() -> bool:
    return bool(_made_here)


def world_of_one(environ: MutableMapping[str, str] | None = None) -> bool:
    """No launcher started this process (`python sdzero/train.py ...`): make it rank 0 of a world of one,
    and return True; under a launcher change nothing and return False.

    Without this, `deepspeed.init_distributed` finds no RANK/MASTER_* and falls back to MPI discovery,
    which needs mpi4py (absent where no MPI compiler was found at install) and ends in a
    ModuleNotFoundError traceback. With these variables it takes torch's env:// rendezvous, on a port
    free here.
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(var) for var in LAUNCHER_VARIABLES):
        return False
    environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=environ.get("MASTER_PORT") or str(free_port()),
    )
    if environ is os.environ:
        _made_here.append(True)
    return True
