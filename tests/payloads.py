"""Hostile files for the loading tests: real pickle payloads, planted where sdzero reads, with the
manifest's sums updated to match (as whoever planted them would do: the manifest sits beside them).

A payload's `__reduce__` is `open(marker, "w")`: unpickled by `pickle` or `torch.load(weights_only=False)`,
it creates the marker file. A test asserts the payload is live (it does create the marker when loaded the
unsafe way), then that sdzero refuses it and the marker never appears.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from sdzero.checkpoint.manifest import MANIFEST, describe_file


class Payload:
    """Unpickles to an open file handle: creating `marker` is the code it runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def plant_in_torch_file(path: Path, marker: Path) -> None:
    """Rewrite a torch file as its own content plus the payload (a checkpoint that still looks whole)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:
        state = {}
    if not isinstance(state, dict):
        state = {"state": state}
    state["payload"] = Payload(marker)
    torch.save(state, path)


def plant_raw_pickle(path: Path, marker: Path) -> None:
    """A plain pickle (not a torch zip) under `path`'s name: for safetensors files and JSON-read files."""
    path.write_bytes(pickle.dumps({"payload": Payload(marker)}))


def reseal(folder: Path) -> None:
    """Update the manifest's size and sha256 of every file it lists (and add any new file)."""
    manifest_path = folder / MANIFEST
    raw = json.loads(manifest_path.read_text())
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            raw["files"][p.relative_to(folder).as_posix()] = describe_file(p)
    manifest_path.write_text(json.dumps(raw, indent=1, sort_keys=True))


def payload_is_live(path: Path, marker: Path) -> bool:
    """Loading `path` the unsafe way (torch.load weights_only=False, or pickle) in a fresh process creates
    the marker: proof that the file would run code. The marker is removed again."""
    code = (
        "import pickle, sys, torch\n"
        "p = sys.argv[1]\n"
        "try:\n    torch.load(p, weights_only=False)\n"
        "except Exception:\n    pickle.loads(open(p, 'rb').read())\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    live = marker.exists()
    marker.unlink(missing_ok=True)
    return live
