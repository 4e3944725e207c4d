"""Releasing DeepSpeed's shared-memory collective buffers on CPU hosts.

On CPUs DeepSpeed's `deepspeed_shm_comm` op creates one 69 MB file per rank in /dev/shm
(`deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`) and never removes it: every run
leaks them, and a machine running many short jobs (tests, advisor trials) fills its RAM with them.
Once every rank has mapped every peer's buffer (inside `init_distributed`), the names are no longer
needed: unlinking them then keeps the mappings alive and lets the kernel free the memory when the
processes exit, however they exit (crash and SIGKILL included).
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_buffer_path(rank: int) -> Path | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not hasattr(os, "getuid"):
        return None
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer(rank: int) -> None:
    """Unlink this rank's buffer name. Call only after a barrier that follows `init_distributed`."""
    path = shm_buffer_path(rank)
    if path is not None:
        path.unlink(missing_ok=True)
