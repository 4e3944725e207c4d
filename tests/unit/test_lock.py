"""requirements/lock.txt pins every dependency pyproject.toml declares, within its floors, and the venv
the tests run in holds those versions (a fresh `make venv` installs from the lock)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
# mpi4py builds against the machine's MPI; `make lock` pins it where mpicc is present (docs/cluster.md).
UNLOCKED_EXTRAS = {"mpi"}


def locked_versions() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"lock line without an exact pin: {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def declared_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    for extra, reqs in project["optional-dependencies"].items():
        if extra not in UNLOCKED_EXTRAS:
            declared += [Requirement(r) for r in reqs]
    return declared


def test_lock_pins_every_declared_dependency_within_its_floor():
    pins = locked_versions()
    for req in declared_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} breaks {req}"


def test_this_venv_holds_the_locked_versions():
    mismatched = {}
    for name, version in locked_versions().items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. an extra this machine skipped; the coverage test above checks the lock itself
        if installed.public != version.public:  # torch 2.13.0+cpu is the locked 2.13.0
            mismatched[name] = f"{installed} installed, {version} locked"
    assert not mismatched, f"venv differs from requirements/lock.txt (tested? then `make lock`): {mismatched}"
