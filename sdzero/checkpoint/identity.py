"""What makes a continuation exact, recorded in every checkpoint's manifest and compared on `--resume`.

A resumed run continues the same optimisation only if everything that shapes a step is the same: the
model (its weights, not the folder's name), the objective, the samples and their order, the batch shape
and the partitioning of the optimizer state. A checkpoint resumed under another micro-batch, for instance,
restarts the data at `batches x new micro-batch` samples and silently skips or repeats data. So each of
these is recorded, and a resume that changes any of them is refused with one line naming every change.

Options that do not change the trajectory may change freely on resume (SAFE_TO_CHANGE).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from sdzero.checkpoint.manifest import RunIdentity
from sdzero.models.families import Family, as_family
from sdzero.models.lora import LoraSettings

SAFE_TO_CHANGE = (
    "--max-steps",
    "--checkpoint-every",
    "--keep-last",
    "--validation-prompts",
    "--validation-every",
    "--validation-inference-steps",
    "--export-final",
    "--export-dtype",
    "--num-workers",
    "--profile-out",
    "--dist-timeout-s",
    "--preempt-timeout-s",
    "--gradient-checkpointing",
    "--output-dir",
)
"""What a resume may change: when to stop, save, sample or report, and how fast, never what is learned."""

LABELS = {
    "zero_stage": "ZeRO stage",
    "dtype": "precision",
    "world_size": "world size (ranks)",
    "model_fingerprint": "model weights/config (--model)",
    "family": "model family",
    "prediction_type": "--prediction-type",
    "micro_batch": "micro-batch (DeepSpeed JSON)",
    "grad_accum": "gradient accumulation (DeepSpeed JSON)",
    "resolution": "--resolution",
    "buckets": "--buckets",
    "data_fingerprint": "data (--data / --cache-dir: files, sizes or captions)",
}


def model_fingerprint(model: str) -> str:
    """Every part of the pipeline, the trained network included (configs in full, weights sampled): a
    moved or copied folder keeps its fingerprint, another checkpoint of the model does not."""
    from sdzero.data import cache

    h = hashlib.sha256(cache.model_fingerprint(model).encode())
    root = Path(model)
    for name in cache.TRAINED_NETS if root.is_dir() else ():
        for path in sorted(p for p in (root / name).rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(root).as_posix()}\0{cache._sampled_digest(path)}\n".encode())
    return h.hexdigest()


def samples_fingerprint(data: Path, cache_dir: Path | None) -> str:
    """The samples: file names, sizes and captions (not mtimes: a copy to a node's scratch disk is the
    same data), or the cache's own digest of what it was built from."""
    if cache_dir is not None:
        from sdzero.data.cache import INDEX_NAME, read_index, spec_from

        return "cache:" + spec_from(read_index(Path(cache_dir) / INDEX_NAME)["spec"]).digest
    from sdzero.data import cache
    from sdzero.data.shards import read_records

    records = read_records(data)
    rows = [[name, size] for name, size, _mtime in cache.data_files(Path(data), records)]
    return cache.rows_fingerprint(rows, records)  # the cache's digest, of rows without mtimes


def objective_settings(cfg: Any, ds: Any, family: Family | str) -> dict[str, Any]:
    """The loss, its weighting and the sample transforms, keyed by the flag that sets each (and the
    family's own options: SD3's flow matching)."""
    return {
        "--snr-gamma": cfg.snr_gamma,
        "--noise-offset": cfg.noise_offset,
        "--random-flip": cfg.random_flip,
        "--random-crop": cfg.random_crop,
        "--lr (effective)": cfg.effective_lr(ds),
        "--lr-warmup-steps": cfg.lr_warmup_steps,
        **as_family(family).identity_options(cfg),
        **(lora.identity() if (lora := LoraSettings.of(cfg, as_family(family))) else {}),
    }


def describe_run(cfg: Any, ds: Any, comps: Any, prediction_type: str, model_reference: str) -> RunIdentity:
    """This run's identity, as the manifest will record it."""
    family = as_family(comps.family)
    return RunIdentity(
        zero_stage=ds.zero_stage,
        dtype=ds.dtype,
        world_size=ds.world_size,
        seed=cfg.seed,
        model=model_reference,
        prediction_type=prediction_type,
        family=family.name,
        model_fingerprint=model_fingerprint(cfg.model),
        micro_batch=ds.micro_batch,
        grad_accum=ds.grad_accum,
        resolution=cfg.resolution or comps.native_resolution,
        buckets=bool(cfg.buckets),
        objective=objective_settings(cfg, ds, family),
        data_fingerprint=samples_fingerprint(cfg.data, cfg.cache_dir),
    )


ELASTIC_MAY_CHANGE = {key: LABELS[key] for key in ("world_size", "micro_batch", "grad_accum")}
"""What --resume-elastic lets differ: the world size, and with it the batch shape (a lost node's ranks
made up by accumulation, say). The data position is kept in samples, so no sample is repeated or
skipped; DeepSpeed's universal checkpoint re-partitions the optimizer state."""


def differences(saved: RunIdentity, now: dict[str, Any], elastic: bool = False) -> list[str]:
    """One phrase per recorded property that `now` changes. A property the checkpoint did not record
    (written by an older sdzero) cannot be checked and is passed over. With `elastic`, a change of world
    size is allowed, and so is the batch shape that comes with it (not the batch shape alone)."""
    out = []
    new_world = now.get("world_size", saved.world_size) != saved.world_size
    for key, value in now.items():
        before = getattr(saved, key, None)
        if key in ("seed", "model") or before is None or before == value:
            continue  # the seed is adopted from the checkpoint; the model is compared by fingerprint
        if elastic and new_world and key in ELASTIC_MAY_CHANGE:
            continue
        if key == "objective":
            out += [
                f"{flag} {before.get(flag)!r} -> {v!r}"
                for flag, v in value.items()
                if flag in before and before[flag] != v
            ]
        elif key.endswith("fingerprint"):
            out.append(f"{LABELS.get(key, key)} changed")
        else:
            out.append(f"{LABELS.get(key, key)} {before} -> {value}")
    if elastic and new_world and saved.buckets and {"micro_batch", "grad_accum"} <= set(now):
        # Each epoch's bucket plan is cut into global batches: another one is another plan.
        was = (saved.micro_batch or 0) * (saved.grad_accum or 0) * saved.world_size
        is_ = now["micro_batch"] * now["grad_accum"] * now["world_size"]
        if saved.micro_batch and saved.grad_accum and was != is_:
            out.append(
                f"global batch under --buckets {was} -> {is_} (keep micro-batch x accumulation x ranks)"
            )
    return out
