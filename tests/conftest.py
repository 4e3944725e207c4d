"""Shared fixtures: the tiny model and synthetic data are built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

# The ranks the tests launch use the venv's own JIT-op folder: importing sdzero (above) set it for this
# process and so for every process it starts (sdzero.use_venv_build_tools).


# The folder is the tier: every test under tests/<tier>/ carries that marker, so `-m "not dist"` and the
# folders always agree (tests/unit runs in one process in seconds; the others start ranks, hosts or a browser).
TIERS = ("dist", "multinode", "browser")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "sd15")


@pytest.fixture(scope="session")
def synth_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "shapes", images=64, size=40)


@pytest.fixture(scope="session", autouse=True)
def _listing_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Image listings the tests' runs remember (sdzero.data.listing) go to the session's temporary
    folder, inherited by every process a test starts, never to the user's ~/.cache."""
    os.environ.setdefault("SDZERO_LISTING_DIR", str(tmp_path_factory.mktemp("listings")))
