"""Fixtures the unit tests share."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-rank gloo group, for the collectives of code under test (the loop's stats, LateFailures)."""
    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
        # DeepSpeed keeps a clone of the world group (deepspeed.utils.groups._WORLD_GROUP) that outlives
        # it: a later module's engine would broadcast over the destroyed group ("Group ... is not
        # registered"), depending on which modules share a pytest-xdist worker.
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None:
            groups._release_process_group_references(None)
