"""Issue #50, checkpoints: a link planted at the staging, checkpoint or checkpoints folder is refused before
DeepSpeed writes a byte, and a save onto a really full filesystem (a small tmpfs, mounted here) is one line
naming the device, with the previous checkpoint intact and no staging folder left.

Apart from tests/unit/test_no_write_through_links.py: these hold a one-rank process group for the module,
which the trainer's own `main` (run in-process there) must not find already up.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from sdzero.errors import UserError


def plant(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


class TinyEngine:
    """A real DeepSpeed engine of a small linear model (one rank, gloo), as the checkpointer drives it."""

    def __init__(self, width: int) -> None:
        import deepspeed

        torch.manual_seed(0)
        model = torch.nn.Linear(width, width)
        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9}
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
        )


@pytest.fixture
def engine(process_group, monkeypatch) -> Iterator[TinyEngine]:
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    tiny = TinyEngine(256)
    yield tiny
    tiny.engine.destroy()


def checkpointer(output_dir: Path, engine: TinyEngine):
    from sdzero.checkpoint import checkpointer as ck

    ident = ck.RunIdentity(
        zero_stage=0, dtype="fp32", world_size=1, seed=0, model="m", prediction_type="epsilon"
    )
    return ck.Checkpointer(output_dir, 3, engine.engine, None, ident)


@pytest.mark.parametrize("where", ["staging", "final", "checkpoints folder"])
def test_a_link_planted_at_the_staging_or_checkpoint_folder_is_refused(tmp_path, engine, where):
    """A link at `.incoming-step_N` once took a checkpoint into another folder, over a user's manifest.json
    there, never to be pruned."""
    from sdzero.checkpoint import checkpointer as ck

    elsewhere = tmp_path / "users-folder"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("mine\n")
    root = ck.checkpoint_root(tmp_path / "run")
    names = {"staging": f"{ck.STAGING_PREFIX}{ck.step_tag(1)}", "final": ck.step_tag(1)}
    link = plant(root / names[where], elsewhere) if where in names else plant(root, elsewhere)
    with pytest.raises(UserError, match=f"{link} is a symbolic link"):
        checkpointer(tmp_path / "run", engine).save(ck.TrainState(step=1))
    assert sorted(p.name for p in elsewhere.iterdir()) == ["manifest.json"]
    assert (elsewhere / "manifest.json").read_text() == "mine\n"


def _checkpoint_bytes(tmp_path: Path, engine: TinyEngine) -> int:
    from sdzero.checkpoint import checkpointer as ck

    probe = tmp_path / "size-probe"
    checkpointer(probe, engine).save(ck.TrainState(step=1))
    return sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())


@pytest.fixture
def small_filesystem(tmp_path) -> Iterator[Callable[[int], Path]]:
    """Mounts a real tmpfs of a given size (root only) and unmounts it at the end."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs to fill needs root (mount -t tmpfs); run as root to prove it")
        point = tmp_path / "small-disk"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "sdzero-full-test", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here ({done.stderr.strip()}); a container without CAP_SYS_ADMIN"
            )
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_save_onto_a_really_full_filesystem_is_one_line_naming_the_device(
    tmp_path, engine, small_filesystem
):
    """No faked OSError: the second checkpoint does not fit on a tmpfs that holds the first one and a half."""
    from sdzero.checkpoint import checkpointer as ck

    one = _checkpoint_bytes(tmp_path, engine)
    page = 4096
    disk = small_filesystem(((one * 3 // 2) // page + 1) * page)
    saver = checkpointer(disk / "run", engine)
    saver.save(ck.TrainState(step=1))
    with pytest.raises(UserError) as refused:
        saver.save(ck.TrainState(step=2))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"no space left on sdzero-full-test (mounted at {disk}) while saving step 2")
    assert "the previous checkpoint 1 is intact" in line
    root = ck.checkpoint_root(disk / "run")
    assert [m.step for _, m in ck.complete_checkpoints(root)] == [1]
    assert ck.distributed_verify(*ck.complete_checkpoints(root)[0]) == []
    assert not list(root.glob(f"{ck.STAGING_PREFIX}*"))  # the half save's space is given back
