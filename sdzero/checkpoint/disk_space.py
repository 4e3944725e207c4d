"""A save that ran out of disk space, told apart from other failed saves, and the filesystem named: the
checkpointer turns it into one line saying which checkpoint is still intact (sdzero.checkpoint.checkpointer)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of space: an ENOSPC/EDQUOT anywhere in the exception's chain, or an
    error without an errno (torch.save on a full disk says "basic_ios::clear: iostream error", then "unexpected
    pos N vs M": no errno, no "write") while the filesystem has (next to) nothing free."""
    seen: BaseException | None = exc
    for _ in range(16):  # the chain is short; a bound, in case of a cycle
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        usage = shutil.disk_usage(root if root.exists() else root.parent)
    except OSError:
        return False
    return usage.free < max(usage.total // 1000, 1 << 20)


def filesystem_of(path: Path) -> str:
    """`DEVICE (mounted at MOUNT)` of the filesystem that holds `path`, from /proc/self/mounts where it
    is readable, else the mount point alone."""
    mount = Path(os.path.abspath(path if path.exists() else path.parent))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 1 and fields[1] == str(mount):
                return f"{fields[0]} (mounted at {mount})"
    except OSError:
        pass
    return str(mount)
