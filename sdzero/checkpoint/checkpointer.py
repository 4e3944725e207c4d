"""Checkpoints you can trust: DeepSpeed's own shards under a commit protocol, a manifest, retention, resume.

Layout under `<output-dir>/checkpoints/`:

    step_00000004/              one complete checkpoint: DeepSpeed's files, ema/, manifest.json
    latest                      the tag of the newest committed checkpoint, replaced atomically
    .incoming-step_00000006/    a save in progress, or one a crash cut short: never loaded, never counted

DeepSpeed's `save_checkpoint` writes shards straight to their final names and rank 0 then writes `latest`
with a plain write, so a job killed mid-save can leave `latest` naming a half-written checkpoint (transformers
PR#35580). The commit protocol on top of it:

1. every rank calls `save_checkpoint` into the staging folder (a collective: calling it on rank 0 alone
   deadlocks, diffusers#2606) and writes its EMA file;
2. barrier; each rank fsyncs and hashes a share of the files, rank 0 gathers sizes and sha256;
3. rank 0 writes manifest.json (temp file, fsync, rename), renames the folder to its final name, then
   replaces `latest` the same way and fsyncs the folder;
4. rank 0 deletes complete checkpoints beyond the newest K and stale staging folders.

A folder without a valid manifest is never loaded and never counted among the K kept; a resume also checks
every file's size and sha256, and falls back to the previous checkpoint with a warning naming the bad file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdzero.atomic import fsync_dir, planted_link, write_text_atomic
from sdzero.checkpoint.disk_space import disk_full, filesystem_of
from sdzero.checkpoint.identity import ELASTIC_MAY_CHANGE, SAFE_TO_CHANGE, differences
from sdzero.checkpoint.manifest import (
    CHECKPOINTS,
    EMA_DIR,
    LATEST,
    MANIFEST,
    STAGING_PREFIX,
    UNIVERSAL_PREFIX,
    Manifest,
    ManifestError,
    RunIdentity,
    checkpoint_root,
    describe_file,
    list_files,
    load_manifest,
    read_manifest,
    step_tag,
    verify_files,
)
from sdzero.checkpoint.output_lock import claim_output_dir
from sdzero.checkpoint.rng_state import capture_rng, restore_rng
from sdzero.checkpoint.safe_load import (
    UnsafeFileError,
    check_safetensors,
    guarded_loads,
    inside,
    scan_for_code,
)
from sdzero.checkpoint.universal import recorded_files, universal_files, universal_for
from sdzero.errors import AgreedError, UserError
from sdzero.models.lora import frozen_base_kwargs

log = logging.getLogger("sdzero.checkpoint.checkpointer")


def complete_checkpoints(root: Path) -> list[tuple[Path, Manifest]]:
    """Folders under `root` with a valid manifest, newest first. Staging folders never count."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if not child.is_dir() or child.name.startswith("."):
            continue
        manifest = read_manifest(child)
        if manifest is not None:
            found.append((child, manifest))
    return sorted(found, key=lambda pm: (pm[1].serial, pm[1].step), reverse=True)


def retention_victims(root: Path, keep_last: int) -> list[Path]:
    """What to delete after a commit: complete checkpoints beyond the newest `keep_last` (0: keep all),
    and staging folders (after a commit none is in progress, so any left is a crashed save's)."""
    root = Path(root)
    complete = complete_checkpoints(root)
    victims = [path for path, _ in complete[keep_last:]] if keep_last > 0 else []
    if root.is_dir():
        victims += sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX))
        # A universal conversion outlives nothing: it goes with its checkpoint (or a crashed conversion's).
        kept = {path.name for path, _ in complete if path not in victims}
        victims += sorted(
            p
            for p in root.iterdir()
            if p.is_dir()
            and p.name.startswith(UNIVERSAL_PREFIX)
            and p.name[len(UNIVERSAL_PREFIX) :] not in kept
        )
    return victims


def next_serial(root: Path) -> int:
    return 1 + max((m.serial for _, m in complete_checkpoints(root)), default=0)


def locate(path: Path) -> tuple[list[tuple[Path, Manifest]], bool]:
    """Resolve a CHECKPOINT argument: (candidates newest first, whether it named one checkpoint).

    Accepted: one checkpoint folder; a folder of checkpoints; a run's output folder (its checkpoints/).
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a folder; pass a checkpoint folder or a run's output folder")
    if (path / MANIFEST).exists() or any(path.glob("*model_states.pt")):
        try:
            return [(path, load_manifest(path))], True
        except ManifestError as exc:
            raise UserError(f"{path} is not a complete checkpoint: {exc}") from exc
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    return complete_checkpoints(root), False


def first_verified(
    candidates: list[tuple[Path, Manifest]],
    verify: Callable[[Path, Manifest], list[str]],
    warn: Callable[[str], None],
) -> tuple[Path, Manifest] | None:
    """The newest candidate whose files all verify; each one skipped is reported with the bad file."""
    for i, (path, manifest) in enumerate(candidates):
        problems = verify(path, manifest)
        if not problems:
            return path, manifest
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        after = "falling back to the previous checkpoint" if i + 1 < len(candidates) else "no older one left"
        warn(f"checkpoint {path} is damaged: {problems[0]}{more}; {after}")
    return None


def check_compatible(path: Path, manifest: Manifest, now: dict[str, Any], elastic: bool = False) -> None:
    """Stop with one line naming every difference when the checkpoint cannot be resumed exactly by this
    run (`now`: RunIdentity fields, all or some of them).

    DeepSpeed partitions the optimizer state by rank; loading it into another world size needs its
    universal-checkpoint conversion, which --resume-elastic asks for (`elastic`: the world size and the
    batch shape may then differ, see sdzero.checkpoint.identity.ELASTIC); loading weights alone would silently
    restart Adam's moments. Another stage, precision, model, objective or dataset would continue a
    different optimisation under the same step count. So the run stops instead.
    """

    changed = differences(manifest, now, elastic=elastic)
    if not changed:
        return
    world = ELASTIC_MAY_CHANGE["world_size"]
    elastic_only = any(c.startswith(world) for c in changed) and all(
        any(c.startswith(label) for label in ELASTIC_MAY_CHANGE.values()) for c in changed
    )
    if elastic_only and not elastic:
        raise UserError(
            f"--resume {path}: the checkpoint was written on another world size ({'; '.join(changed)}); pass "
            "--resume-elastic to "
            "continue it on this world size through DeepSpeed's universal checkpoint (converted once, beside "
            "it), or resume on the original number of ranks"
        )
    raise UserError(
        f"--resume {path}: this run differs from the one that wrote the checkpoint: {'; '.join(changed)}. "
        f"An exact continuation needs them unchanged (safe to change: {', '.join(SAFE_TO_CHANGE)}"
        f"{'; with --resume-elastic also the world size and batch shape' if elastic else ''}). Resume "
        f"with the original settings, or start a new run from its weights: `sdzero export {path} OUT`, "
        "then --model OUT"
    )


def check_ema_files(path: Path, manifest: Manifest) -> None:
    """Every file under `ema/` is one the manifest lists and a readable safetensors file: the EMA loaders
    glob the folder, so a file planted beside the listed ones would otherwise be read."""
    folder = path / EMA_DIR
    listed = {name for name in manifest.files if name.startswith(f"{EMA_DIR}/")}
    if folder.is_dir():
        for found in sorted(folder.iterdir()):
            if f"{EMA_DIR}/{found.name}" not in listed:
                raise UnsafeFileError(
                    f"{found}: not one of the files the checkpoint's manifest lists; refused (remove it, or "
                    "get the checkpoint again from whoever wrote it)"
                )
    for name in sorted(listed):
        check_safetensors(path / name)


@contextlib.contextmanager
def ema_errors_as_user_errors(path: Path) -> Iterator[None]:
    """The EMA readers' ValueErrors (metadata that is not sdzero's, fragments that do not cover a tensor)
    describe the checkpoint, not a bug: one line."""
    try:
        yield
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise UserError(f"checkpoint {path}: its EMA cannot be read ({exc})") from None


@dataclass(frozen=True)
class TrainState:
    """Where training continues: the last completed optimizer step and the data position after it."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    """Micro-batches this rank has taken from the current epoch (the same count on every rank)."""
    samples_in_epoch: int | None = None
    """Samples of the current epoch all ranks have taken together: the data position a resume on any world
    size continues from (None in checkpoints of older sdzero: batches x micro-batch x world size)."""


@dataclass
class ResumePoint:
    path: Path
    manifest: Manifest
    verify_s: float = 0.0
    skipped: list[str] = field(default_factory=list)
    universal: Path | None = None
    """--resume-elastic on another world size: the folder holding DeepSpeed's universal form of `path`
    (as a checkpoint named like it); the engine must then be configured with load_universal."""


def agree_on_refusal(mine: str | None) -> None:
    """Stop every rank when any rank refused a file (a collective). A file that one rank alone reads (its
    ZeRO optimizer shard) is refused on that rank only; without this the others would run on into the next
    collective, find their peer gone, and end in a gloo/NCCL traceback instead of the refusal's one line."""
    import torch.distributed as dist

    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, mine)
    first = next((v for v in verdicts if v is not None), None)
    if first is not None:
        raise AgreedError(first)


def prescan(folder: Path, names: Any) -> None:
    """Every rank scans a share of the checkpoint's torch files for code (safe_load.scan_for_code: the
    pickles' opcodes only), and all ranks stop together on a finding. A collective.

    Before DeepSpeed's loader runs at all: under ZeRO-3 every rank loads its own model-states file, and
    a refusal on one rank inside the loader would leave the others waiting in the loader's own collectives,
    where no agreement after it can reach them."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch_files = sorted(str(n) for n in names if str(n).endswith(".pt"))
    refused: str | None = None
    try:
        for name in torch_files[rank::world]:
            scan_for_code(Path(folder) / name)
    except UserError as exc:
        refused = str(exc)
    agree_on_refusal(refused)


def distributed_verify(path: Path, manifest: Manifest) -> list[str]:
    """Every rank checks a share of the files; all ranks get the same problem list. A collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = verify_files(path, manifest, sorted(manifest.files)[rank::world])
    shares: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(shares, mine)
    return sorted(p for share in shares for p in share)


def find_resume(
    resume: str,
    output_dir: Path,
    zero_stage: int,
    dtype: str,
    world_size: int,
    elastic: bool = False,
    ds_raw: dict[str, Any] | None = None,
) -> ResumePoint | None:
    """The checkpoint to resume from, agreed by all ranks (a collective), or None for a fresh start."""
    import torch.distributed as dist

    rank = dist.get_rank()
    root = checkpoint_root(output_dir)
    # Rank 0 claims the output folder and lists, everyone uses its answer: ranks must agree (also when a
    # shared filesystem lags), and a refusal must stop every rank, not leave the others in a collective.
    listing: list[Any] = [None]
    if rank == 0:
        try:
            claim_output_dir(output_dir)
            found = None
            if resume != "none":
                found = (complete_checkpoints(root), False) if resume == "auto" else locate(Path(resume))
            listing[0] = ("ok", found)
        except UserError as exc:
            listing[0] = ("error", str(exc))
    dist.broadcast_object_list(listing, src=0)
    status, found = listing[0]
    if status == "error":
        raise UserError(found)
    if resume == "none":
        if rank == 0 and complete_checkpoints(root):
            log.warning(
                "%s holds checkpoints from an earlier run; starting fresh as --resume none says (pass "
                "--resume auto to continue from them)",
                root,
            )
        return None
    candidates, _ = found
    if resume == "auto" and not candidates:
        if rank == 0:
            log.info("--resume auto: no complete checkpoint under %s; starting fresh", root)
        return None
    start = time.perf_counter()
    skipped: list[str] = []
    warn = (lambda msg: (skipped.append(msg), log.warning(msg))) if rank == 0 else skipped.append
    chosen = first_verified(candidates, distributed_verify, warn)
    if chosen is None:
        if resume != "auto":
            why = skipped[-1] if skipped else "no folder there has a valid manifest.json"
            raise UserError(f"--resume {resume}: no complete, undamaged checkpoint ({why})")
        if rank == 0:
            log.warning("--resume auto: every checkpoint under %s is damaged; starting fresh", root)
        return None
    path, manifest = chosen
    # The partitioning, early (before any model loads); everything else once the run is known (load).
    now = {"zero_stage": zero_stage, "dtype": dtype, "world_size": world_size}
    check_compatible(path, manifest, now, elastic=elastic)
    point = ResumePoint(path, manifest, verify_s=time.perf_counter() - start, skipped=skipped)
    if elastic and manifest.world_size != world_size:
        point.universal = universal_for(path, manifest, world_size, ds_raw or {})  # rank 0 converts
    return point


def no_space_line(root: Path, step: int) -> str:
    complete = complete_checkpoints(root) if root.exists() else []
    previous = (
        f"the previous checkpoint {complete[0][1].step} is intact ({complete[0][0]})"
        if complete
        else "no earlier checkpoint of this run exists"
    )
    return (
        f"no space left on {filesystem_of(root)} while saving step {step}: {previous}; free space (or "
        "lower --keep-last) and rerun with --resume auto"
    )


class Checkpointer:
    """Saves and restores engine + EMA + data position + RNG under the commit protocol above."""

    def __init__(
        self, output_dir: Path, keep_last: int, engine: Any, ema: Any, ident: RunIdentity, parts: tuple = ()
    ) -> None:
        """`parts`: more writers into each checkpoint, `save(staging, rank)` on every rank (a LoRA adapter)."""
        import torch.distributed as dist

        self.frozen_kwargs, self.load_kwargs = frozen_base_kwargs(engine)  # a LoRA run's base: not saved

        self.root = checkpoint_root(output_dir)
        self.keep_last = keep_last
        self.engine = engine
        self.ema = ema
        self.ident, self.parts = ident, parts
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.before_commit: Callable[[int, Path], None] | None = None
        """Called on every rank with (step, staging folder) once every shard is written and hashed, just
        before rank 0 commits: the Trainer's `on_checkpoint_staged` event (tests kill a rank there)."""
        if engine.checkpoint_engine.is_decoupled():
            raise UserError(
                "the DeepSpeed JSON selects a decoupled (asynchronous) checkpoint engine; sdzero's commit "
                "protocol needs every shard on disk before the manifest, so remove that setting"
            )

    def save(self, state: TrainState) -> Path:
        """Write a complete checkpoint of `state`; every rank must call it. Returns its folder.

        A disk that fills during the save is one line (the previous checkpoint is untouched: the new one
        was still in its staging folder, which is removed to give the space back)."""
        staging = self.root / f"{STAGING_PREFIX}{step_tag(state.step)}"
        try:
            return self._save(state)
        except (OSError, RuntimeError) as exc:
            if not disk_full(exc, self.root):
                raise
            shutil.rmtree(staging, ignore_errors=True)
            raise UserError(no_space_line(self.root, state.step)) from None

    def _save(self, state: TrainState) -> Path:
        import torch.distributed as dist

        t0 = time.perf_counter()
        tag = step_tag(state.step)
        staging = self.root / f"{STAGING_PREFIX}{tag}"
        final = self.root / tag
        # A link planted at any of these would take the shards (or the commit) into another folder: every
        # rank stops together on it, before DeepSpeed writes a byte.
        replaced = final.with_name(f"{final.name}.replaced")
        agree_on_refusal(planted_link(self.root, staging, final, replaced, self.root / LATEST))
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # a crashed save of the same step
        dist.barrier()  # nobody writes into the staging folder before it is clean
        rng = [None] * self.world
        dist.all_gather_object(rng, capture_rng())
        client_state = {
            "sdzero": {**asdict(state), "rng": rng, "seed": self.ident.seed, "ema": self._ema_info()}
        }
        self.engine.save_checkpoint(
            str(self.root),
            tag=staging.name,
            client_state=client_state,
            save_latest=False,
            **self.frozen_kwargs,
        )
        if self.ema is not None:
            self.ema.save(staging / EMA_DIR, self.rank)
        for part in self.parts:
            part.save(staging, self.rank)
        dist.barrier()  # every rank's shards are written
        t_write = time.perf_counter()

        names: list[Any] = [list_files(staging) if self.rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        mine = {n: describe_file(staging / n, fsync=True) for n in names[0][self.rank :: self.world]}
        shares: list[Any] = [None] * self.world
        dist.all_gather_object(shares, mine)
        t_hash = time.perf_counter()

        if self.before_commit is not None:
            self.before_commit(state.step, staging)
        if self.rank == 0:
            files = {k: v for share in shares for k, v in share.items()}
            self._commit(staging, final, state.step, files)
        dist.barrier()  # nobody goes on (or exits) before the commit is durable
        if self.rank == 0:
            total = sum(v["bytes"] for share in shares for v in share.values())
            log.info(
                "checkpoint %s: %.1f MB in %.2f s (write %.2f s, fsync+sha256 %.2f s, commit %.2f s)",
                final,
                total / 1e6,
                time.perf_counter() - t0,
                t_write - t0,
                t_hash - t_write,
                time.perf_counter() - t_hash,
            )
        return final

    def _ema_info(self) -> dict[str, Any] | None:
        if self.ema is None:
            return None
        return {"decay": self.ema.decay, "updates": self.ema.updates, "folder": EMA_DIR}

    def _commit(self, staging: Path, final: Path, step: int, files: dict[str, Any]) -> None:
        manifest = Manifest(
            tag=final.name,
            step=step,
            serial=next_serial(self.root),
            ema=self.ema is not None,
            files=files,
            created_unix_s=time.time(),
            **asdict(self.ident),
        )
        write_text_atomic(staging / MANIFEST, manifest.to_json())
        # The same step saved by an earlier timeline: replaced only now. The old copy moves aside under a
        # visible name, so a kill between the two renames leaves it listed (its manifest is valid) rather
        # than hidden among staging folders with nothing at `final`; an interrupted commit's is removed.
        old = final.with_name(f"{final.name}.replaced")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            fsync_dir(self.root)
        os.replace(staging, final)
        fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        write_text_atomic(self.root / LATEST, final.name)
        for victim in retention_victims(self.root, self.keep_last):
            shutil.rmtree(victim, ignore_errors=True)

    def load(self, point: ResumePoint) -> TrainState:
        """Restore engine, optimizer, LR schedule, EMA and this rank's RNG; every rank must call it."""
        t0 = time.perf_counter()
        path = point.path
        elastic = point.universal is not None
        check_compatible(path, point.manifest, asdict(self.ident), elastic=elastic)  # same on every rank
        load_from = point.universal if elastic else path.parent
        check_ema_files(path, point.manifest)
        # DeepSpeed's checkpoint engine (and its universal loader) calls torch.load(weights_only=False):
        # inside the guard that is the weights-only load, of the listed files only (sdzero.checkpoint.safe_load).
        allowed = universal_files(point.universal) if elastic else inside(path, point.manifest.files)
        # Every rank, before any enters DeepSpeed's loader: a rank's own file refused inside it (ZeRO-3)
        # would leave the others in the loader's collectives.
        if point.universal is not None:
            prescan(point.universal, recorded_files(point.universal) or {})
        else:
            prescan(path, point.manifest.files)
        refused: str | None = None
        try:
            with guarded_loads(allowed):
                load_path, client_state = self.engine.load_checkpoint(
                    str(load_from),
                    tag=path.name,
                    **self.load_kwargs,  # a LoRA run's module state holds no base weight
                    load_optimizer_states=True,
                    load_lr_scheduler_states=True,
                )
        except UserError as exc:
            refused = str(exc)
        agree_on_refusal(refused)
        if load_path is None or not client_state or "sdzero" not in client_state:
            raise UserError(
                f"--resume {path}: DeepSpeed found no model states there; is it an sdzero checkpoint?"
            )
        saved = client_state["sdzero"]
        # Per-sample randomness is keyed by (seed, epoch, index), not by these streams; on another world
        # size a new rank takes the stream of the rank of its number modulo the old world size.
        restore_rng(saved["rng"][self.rank % len(saved["rng"])])
        if self.ema is not None:
            if saved.get("ema"):
                with ema_errors_as_user_errors(path):
                    self.ema.load(path / EMA_DIR, self.rank)
            elif self.rank == 0:
                log.warning("%s has no EMA; the EMA starts from the resumed weights", path)
        elif saved.get("ema") and self.rank == 0:
            log.warning("%s holds an EMA but --ema-decay is not set; it is not carried on", path)
        samples = saved.get("samples_in_epoch")
        micro = point.manifest.micro_batch
        if samples is None and micro is not None:  # an older sdzero's: micro-batches of every rank
            samples = int(saved["batches_in_epoch"]) * micro * point.manifest.world_size
        state = TrainState(
            step=int(saved["step"]),
            epoch=int(saved["epoch"]),
            batches_in_epoch=int(saved["batches_in_epoch"]),
            samples_in_epoch=None if samples is None else int(samples),
        )
        if self.rank == 0:
            log.info(
                "resumed from %s (step %d%s) in %.2f s (verify %.2f s, load %.2f s)",
                path,
                state.step,
                f", {point.manifest.world_size} -> {self.world} ranks through {point.universal}"
                if elastic
                else "",
                point.verify_s + time.perf_counter() - t0,
                point.verify_s,
                time.perf_counter() - t0,
            )
        return state
