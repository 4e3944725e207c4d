"""A plain `pytest` from the repository root collects every tier (issue #44): two test files with one
basename in two tier folders (which have no __init__.py) stop the whole collection with "import file
mismatch", and `make test`, running the tiers apart, never showed it."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_test_files_share_a_basename():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_pytest_from_the_root_collects_every_tier_without_an_error():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    collected = done.stdout
    for tier in ("tests/unit/", "tests/dist/", "tests/multinode/", "tests/browser/"):
        assert tier in collected, f"nothing collected from {tier}"
