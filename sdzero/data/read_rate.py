"""One node's read rate at the data's location, for `sdzero doctor --data`: a seeded sample of the images
(loose files or shard members), read by as many threads as the node runs loader workers, each file first
dropped from the page cache (sdzero.data.input_probe.measure_storage). Every node starts at the same
agreed wall-clock second, so that the nodes read at once and the shared storage serves them together.

Run on each node as `python -m sdzero.data.read_rate --data D --files N --readers R --start-at T
--sample S`, printing one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sdzero.data.input_probe import measure_storage
from sdzero.data.shards import read_records

READ_SECONDS = 3.0
"""At most this long per node: long enough to pass the storage's caches, short for a pre-flight check."""


def read_sample(data: Path | str, files: int, readers: int, start_at: float, sample: int) -> dict[str, Any]:
    """This node's read of `files` images of `data` (the `sample`-th seeded pick: each node its own), from
    the wall-clock second `start_at`."""
    records = read_records(data)
    picked = random.Random(sample).sample(records, min(files, len(records)))
    time.sleep(max(0.0, start_at - time.time()))
    started = time.time()
    measured = measure_storage(picked, readers, READ_SECONDS) or {}
    return {
        "host": socket.gethostname(),
        "started": started,
        "ended": time.time(),
        **{k: measured.get(k) for k in ("bytes_per_s", "files_per_s", "files", "readers", "seconds")},
        "bytes": (measured.get("bytes_per_s") or 0.0) * (measured.get("seconds") or 0.0),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m sdzero.data.read_rate")
    parser.add_argument("--data", required=True)
    parser.add_argument("--files", type=int, default=64)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--sample", type=int, default=0)
    a = parser.parse_args(argv)
    print(json.dumps(read_sample(a.data, a.files, a.readers, a.start_at, a.sample)))


if __name__ == "__main__":
    main(sys.argv[1:])
