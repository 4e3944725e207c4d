"""Fixtures the unit tests share."""

from __future__ import annotations

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
        forget_deepspeed_world_group()


def forget_deepspeed_world_group() -> None:
    """DeepSpeed keeps a clone of the world group (deepspeed.utils.groups._WORLD_GROUP) once an engine asked for
    it; after the group is destroyed, a later module's engine would be handed that dead clone ("Group ... is
    not registered") instead of one of its own group."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._WORLD_GROUP = None
