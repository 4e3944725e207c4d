"""Each training rank under a CPU quota of its own: Python imports this at start-up when this folder is on
PYTHONPATH (the scale-out bench puts it there, locally and in .deepspeed_env).

With SDZERO_RANK_CPUS set, a process that DeepSpeed's launcher started as a rank (LOCAL_RANK in its
environment) moves itself into `rank<LOCAL_RANK>`, a child of the cgroup it was started in (a host's
quota, or the 1-host trial's), limited to SDZERO_RANK_CPUS cores. Without it the ranks of one group share
its quota freely: a rank whose peers wait in a collective runs faster than its share, so a 1-host trial's
compute would be faster than the same ranks' compute on hosts of their own. Processes the rank starts
(DataLoader workers) inherit its group. Anything that fails (not root, cgroup v2, whose groups with
processes cannot have children with controllers) leaves the rank where it was: its host's share still holds.

Works for the 1-host trial's ranks and for a namespace host's: the host's sshd enters the host's network
namespace only (nsenter --net), so /sys/fs/cgroup stays visible to what it starts (`ip netns exec` would
mount a fresh /sys and hide it, and a 2-rank host's ranks would share its quota freely).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path


def _join_rank_group() -> None:
    cpus, local_rank = os.environ.get("SDZERO_RANK_CPUS"), os.environ.get("LOCAL_RANK")
    if not cpus or local_rank is None:
        return
    spec = importlib.util.spec_from_file_location(
        "sdzero_cpushare", Path(__file__).parents[1] / "cpushare.py"
    )
    cpushare = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cpushare  # its dataclasses look their module up there
    spec.loader.exec_module(cpushare)
    with contextlib.suppress(OSError, cpushare.CpuShareUnavailable, ValueError):
        fs = cpushare.detect()
        if fs.version != 1:
            return
        here = cpushare.own_group(fs)
        if here.name.startswith("rank"):
            return  # already in a rank's group (a worker this rank started)
        cpushare.create(
            fs, str((here / f"rank{local_rank}").relative_to(fs.root)), float(cpus), exist_ok=True
        )
        cpushare.join(here / f"rank{local_rank}", os.getpid())


_join_rank_group()
