"""Shared fixtures: the tiny model and synthetic data are built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sdzero.tiny import write_synthetic_dataset, write_tiny_model

# The ranks the tests launch use the venv's own JIT-op folder (see the Makefile for why), also when
# pytest runs without make.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "sd15")


@pytest.fixture(scope="session")
def synth_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "shapes", images=64, size=40)
