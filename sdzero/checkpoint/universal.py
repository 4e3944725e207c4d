"""Resume on another world size (--resume-elastic) through DeepSpeed's universal checkpoint.

ZeRO saves each rank's slice of the fp32 master weights and optimizer moments; a checkpoint written by N
ranks cannot be loaded by M. DeepSpeed's `ds_to_universal` rewrites it as one file per parameter and
optimizer state (`zero/<name>/fp32.pt, exp_avg.pt, ...`), which an engine configured with
`checkpoint: {load_universal: true}` slices anew for its own ranks (`load_universal_checkpoint`).

The conversion runs once, on rank 0, into `<checkpoints>/.universal-<tag>/<tag>/` beside the checkpoint:
written under a temporary name and renamed when complete, so a crash leaves nothing that looks done; a
later resume of the same checkpoint reuses it (`source.json` names the checkpoint it was made from, so a
step saved again by another timeline is converted again, and lists every file it wrote with its size and
sha256: the engine loads only those, weights-only, see sdzero.checkpoint.safe_load). Retention deletes it
with its checkpoint.

What DeepSpeed 0.19 supports, read from its source (runtime/zero/stage_1_and_2.py, stage3.py,
bf16_optimizer.py, checkpoint/ds_to_universal.py), and what sdzero therefore allows:
- ZeRO-1 and ZeRO-2, fp32/bf16/fp16: every optimizer state key is re-sliced (`load_hp_checkpoint_state`);
  the fp16 loss scaler is restored from the common optimizer state.
- ZeRO-3, fp32/bf16/fp16: only Adam's states are restored (`load_hp_checkpoint_state_from_checkpoint_dir_
  stage3` reads exactly fp32, exp_avg and exp_avg_sq), so another optimizer is refused.
- ZeRO stage 0 has no partitioned optimizer state: nothing to convert (refused; sdzero trains at 1-3).
- NVMe optimizer offload swaps its own files outside the checkpoint's layout: refused.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import uuid
from argparse import Namespace
from pathlib import Path
from typing import Any

from sdzero.atomic import fsync_dir, remove_tree, write_text_atomic
from sdzero.checkpoint.manifest import (
    UNIVERSAL_PREFIX,
    UNIVERSAL_SOURCE,
    Manifest,
    describe_file,
    list_files,
    safe_relative,
)
from sdzero.checkpoint.safe_load import Allow, guarded_loads, inside, under
from sdzero.errors import UserError

log = logging.getLogger("sdzero.checkpoint.checkpointer")

ADAM_STATES = {"adam", "adamw"}
"""Optimizer types (DeepSpeed JSON `optimizer.type`, lower case) whose state is fp32 + exp_avg + exp_avg_sq;
None (no optimizer section) is sdzero's own torch AdamW."""


def unsupported(manifest: Manifest, optimizer: str | None, nvme_offload: bool = False) -> str | None:
    """Why DeepSpeed cannot continue this checkpoint on another world size, or None when it can."""
    if manifest.zero_stage not in (1, 2, 3):
        return f"ZeRO stage {manifest.zero_stage} has no partitioned optimizer state to convert"
    if nvme_offload:
        return "NVMe optimizer offload keeps its state in swap files that the universal format does not carry"
    if manifest.zero_stage == 3 and optimizer is not None and optimizer.lower() not in ADAM_STATES:
        return (
            f"DeepSpeed's ZeRO-3 universal loader restores only Adam's states (fp32, exp_avg, exp_avg_sq), "
            f"not those of optimizer {optimizer!r}"
        )
    return None


def source_of(path: Path, manifest: Manifest) -> dict[str, Any]:
    """What identifies the converted checkpoint: the same tag saved again is another checkpoint."""
    return {"tag": path.name, "serial": manifest.serial, "created_unix_s": manifest.created_unix_s}


def recorded_files(target: Path) -> dict[str, dict[str, Any]] | None:
    """The files a universal folder's source.json lists (written with the conversion), or None when it
    lists none that are all plain paths inside the folder."""
    try:
        files = json.loads((target / UNIVERSAL_SOURCE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    root = target.resolve()
    if not isinstance(files, dict) or not files:
        return None
    for name, entry in files.items():
        if (
            not safe_relative(name)
            or not (root / name).resolve().is_relative_to(root)
            or not isinstance(entry, dict)
            or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            return None
    return files


def reusable(target: Path, path: Path, manifest: Manifest) -> bool:
    """A complete conversion of this very checkpoint whose files all still match what it recorded."""
    try:
        source = json.loads((target / UNIVERSAL_SOURCE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(source, dict) or {k: source.get(k) for k in source_of(path, manifest)} != source_of(
        path, manifest
    ):
        return False
    files = recorded_files(target)
    if files is None:  # an older sdzero's conversion, or a hand-made one: converted again
        return False
    for name, entry in files.items():
        file = target / name
        if not file.is_file() or describe_file(file) != {"bytes": entry["bytes"], "sha256": entry["sha256"]}:
            log.warning("--resume-elastic: %s does not match its conversion's record; converting again", file)
            return False
    return True


def universal_files(target: Path) -> Allow:
    """What the engine may load from a universal folder: the files its conversion recorded, nothing else."""
    return inside(target, recorded_files(target) or {})


def converted(path: Path, manifest: Manifest) -> Path:
    """The universal folder of `path` (made now unless a complete one for this checkpoint exists); no
    process group needed: run on one process."""
    target = path.parent / f"{UNIVERSAL_PREFIX}{path.name}"
    if reusable(target, path, manifest):
        log.info("--resume-elastic: reusing the universal checkpoint %s", target)
        return target
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    temp = path.parent / f"{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    args = Namespace(
        input_folder=str(path),
        output_folder=str(temp / path.name),
        num_extract_workers=1,  # no forked pool inside a process that holds a process group
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # sdzero's UNet carries no universal_checkpoint_info of its own
    )
    output = io.StringIO()
    try:
        # It reads the checkpoint's listed files and its own temporary ones, weights-only (safe_load).
        with (
            guarded_loads(inside(path, manifest.files), under(temp)),
            contextlib.redirect_stdout(output),
            contextlib.redirect_stderr(output),
        ):
            ds_to_universal(args)
    except UserError:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(temp, ignore_errors=True)
        last = output.getvalue().strip().splitlines()[-1:] or [""]
        raise UserError(
            f"--resume-elastic: DeepSpeed could not convert {path} to a universal checkpoint "
            f"({type(exc).__name__}: {exc}; {last[0]}); resume on the original number of ranks"
        ) from exc
    files = {
        name: describe_file(temp / name, fsync=True) for name in list_files(temp) if name != UNIVERSAL_SOURCE
    }
    record = {**source_of(path, manifest), "files": files}
    write_text_atomic(temp / UNIVERSAL_SOURCE, json.dumps(record) + "\n")
    remove_tree(target)  # a conversion of an earlier checkpoint of this step
    os.replace(temp, target)
    fsync_dir(path.parent)
    log.info("--resume-elastic: converted %s to a universal checkpoint in %s", path, target)
    return target


def universal_for(path: Path, manifest: Manifest, world_size: int, ds_raw: dict[str, Any]) -> Path:
    """The universal folder to load `path` from on `world_size` ranks under the DeepSpeed JSON `ds_raw`;
    rank 0 converts, every rank gets its answer (a collective). The others wait under a timeout sized for
    reading the checkpoint and writing its conversion (sdzero.process.rank0_wait), not --dist-timeout-s: an
    SDXL-size conversion on a shared filesystem can take longer than a step's collectives may."""
    import torch.distributed as dist

    from sdzero.process.rank0_wait import waiting_for_rank0

    optimizer = ds_raw.get("optimizer", {}).get("type")
    offload = ds_raw.get("zero_optimization", {}).get("offload_optimizer") or {}
    answer: Any = None
    with waiting_for_rank0(2 * manifest.total_bytes) as share:  # read it all, write about as much
        if dist.get_rank() == 0:
            why = unsupported(manifest, optimizer, nvme_offload=offload.get("device") == "nvme")
            try:
                if why is not None:
                    raise UserError(
                        f"--resume-elastic {path}: written by {manifest.world_size} ranks, resumed on "
                        f"{world_size}, but {why}; resume on {manifest.world_size} ranks"
                    )
                answer = ("ok", str(converted(path, manifest)))
            except UserError as exc:
                answer = ("error", str(exc))
        status, value = share(answer)
    if status == "error":
        raise UserError(value)
    return Path(value)
