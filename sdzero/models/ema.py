"""EMA of the trained weights, kept where ZeRO keeps the fp32 master weights: each rank averages its slice.

Why slices: under ZeRO-3 the module's parameters are empty placeholders. diffusers' `EMAModel` gathers
them every step when ZeRO-3 is on, which moves the whole model to every rank on every step (DeepSpeed#6987);
a naive copy of `module.parameters()` averages nothing at all. Here each rank averages only the fp32
master fragment its optimizer owns: 4 bytes x trained params / ranks of memory, no communication per step.

Where the fragment comes from:
- ZeRO-3: DeepSpeed's local API (`safe_get_local_fp32_param`): this rank's partition of each parameter.
- ZeRO-1/2 (and the bf16 optimizer at stage 0): `param._hp_mapping`, the view DeepSpeed keeps from each
  parameter into the rank's flat fp32 partition; a parameter may be split across two ranks.
- stage 0 otherwise (no partitions): the whole parameter, held by rank 0 only.

The decay follows diffusers' `EMAModel` defaults exactly: min(decay, (1 + t) / (10 + t)) with t = updates - 1,
so the first update copies the weights. Checkpoints hold one safetensors file per rank with each
fragment's place in its parameter; `assemble` puts the full tensors back together without a process group.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FILE_PATTERN = "rank_{:05d}.safetensors"


@dataclass(frozen=True)
class Fragment:
    """Where a slice sits: elements [start, start + numel) of the flattened parameter `name`."""

    name: str
    start: int
    numel: int
    shape: tuple[int, ...]


def ema_decay(decay: float, updates: int) -> float:
    """diffusers EMAModel.get_decay with its defaults (update_after_step 0, no power warm-up, min_decay 0)."""
    t = updates - 1
    if t <= 0:
        return 0.0
    return min(decay, (1 + t) / (10 + t))


def local_fp32_fragments(engine: Any) -> list[tuple[Fragment, torch.Tensor]]:
    """This rank's fp32 master slice of every trained parameter, as views where DeepSpeed allows.

    Fetched anew on each call: DeepSpeed relinks the views when it loads a checkpoint, and under optimizer
    offload the ZeRO-3 API returns a fresh copy on the accelerator.
    """
    out: list[tuple[Fragment, torch.Tensor]] = []
    zero3 = engine.zero_optimization_partition_weights()
    rank = dist.get_rank()
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if zero3:
            from deepspeed.utils import safe_get_local_fp32_param

            shape = tuple(param.ds_shape)
            part = int(param.ds_tensor.ds_numel)  # partition size; the last rank's slice is padded
            owner = engine.optimizer._get_param_partition_rank(param)
            start = owner * part
            numel = max(0, min(part, math.prod(shape) - start))
            if numel:
                hp = safe_get_local_fp32_param(param)
                out.append((Fragment(name, start, numel, shape), hp.reshape(-1).narrow(0, 0, numel)))
            continue
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            addr = mapping.lp_fragment_address
            frag = Fragment(name, int(addr.start), int(addr.numel), tuple(param.shape))
            out.append((frag, mapping.hp_fragment.reshape(-1)))
        elif not engine.zero_optimization() and rank == 0:
            # Plain data parallel: every rank holds the same full weights; one copy is enough.
            out.append((Fragment(name, 0, param.numel(), tuple(param.shape)), param.detach().reshape(-1)))
    return out


class ShardedEMA:
    """Exponential moving average of this rank's fp32 master fragments (see the module docstring)."""

    def __init__(self, engine: Any, decay: float, device: torch.device | None = None) -> None:
        self.engine = engine
        self.decay = decay
        self.updates = 0
        frags = local_fp32_fragments(engine)
        self.fragments = [f for f, _ in frags]
        # Under optimizer offload the masters live in host memory; keep the average there too.
        self.device = device
        self.shadow = [t.detach().to(device or t.device, torch.float32, copy=True) for _, t in frags]

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step after an optimizer step; local only, no collective."""
        current = local_fp32_fragments(self.engine)
        if [f for f, _ in current] != self.fragments:
            raise RuntimeError("EMA: DeepSpeed's partitioning changed during the run")
        self.updates += 1
        one_minus = 1.0 - ema_decay(self.decay, self.updates)
        values = [t.to(s.device, torch.float32) for s, (_, t) in zip(self.shadow, current, strict=True)]
        if self.shadow:
            # The same arithmetic as EMAModel(foreach=True): s -= (1 - d) * (s - p).
            torch._foreach_sub_(self.shadow, torch._foreach_sub(self.shadow, values), alpha=one_minus)

    def save(self, folder: Path, rank: int) -> Path:
        """This rank's fragments as safetensors (never pickle); written by every rank."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FILE_PATTERN.format(rank)
        tensors = {
            f.name: s.detach().cpu().contiguous() for f, s in zip(self.fragments, self.shadow, strict=True)
        }
        save_file(tensors, str(path), metadata=_metadata(self.fragments, self.decay, self.updates))
        return path

    def load(self, folder: Path, rank: int) -> None:
        """Restore from a checkpoint: this rank's own file when the layout matches, else re-slice the whole."""
        from safetensors import safe_open

        own = folder / FILE_PATTERN.format(rank)
        if own.is_file():
            with safe_open(str(own), framework="pt") as f:
                meta = _parse_metadata(f.metadata(), own)
                if meta["fragments"] == self.fragments:
                    self.shadow = [
                        f.get_tensor(fr.name).to(s.device)
                        for fr, s in zip(self.fragments, self.shadow, strict=True)
                    ]
                    self.updates = meta["updates"]
                    return
        full, updates = assemble(folder)
        self.updates = updates
        for i, frag in enumerate(self.fragments):
            flat = full[frag.name].reshape(-1)[frag.start : frag.start + frag.numel]
            self.shadow[i] = flat.to(self.shadow[i].device, torch.float32).clone()

    def gather_full(self) -> dict[str, torch.Tensor] | None:
        """The full EMA weights on rank 0 (None elsewhere). A collective: every rank must call it.

        Costs one transfer of the whole EMA to rank 0 and one fp32 copy of the model in its host memory;
        used once, at export time.
        """
        mine = [(f, s.detach().cpu()) for f, s in zip(self.fragments, self.shadow, strict=True)]
        rank = dist.get_rank()
        parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if rank != 0:
            return None
        assert parts is not None
        return _join([pair for part in parts for pair in part])


def _metadata(fragments: list[Fragment], decay: float, updates: int) -> dict[str, str]:
    return {
        "fragments": json.dumps([[f.name, f.start, f.numel, list(f.shape)] for f in fragments]),
        "decay": repr(decay),
        "updates": str(updates),
    }


def _parse_metadata(meta: dict[str, str] | None, path: Path) -> dict[str, Any]:
    try:
        assert meta is not None
        fragments = [
            Fragment(n, int(s), int(k), tuple(shape)) for n, s, k, shape in json.loads(meta["fragments"])
        ]
        return {"fragments": fragments, "decay": float(meta["decay"]), "updates": int(meta["updates"])}
    except (AssertionError, KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not an sdzero EMA file (metadata missing or malformed)") from exc


def _join(pairs: list[tuple[Fragment, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from fragments; every element must be covered exactly once."""
    shapes: dict[str, tuple[int, ...]] = {}
    flats: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for frag, values in pairs:
        if frag.name not in flats:
            shapes[frag.name] = frag.shape
            flats[frag.name] = torch.empty(math.prod(frag.shape), dtype=torch.float32)
            covered[frag.name] = 0
        flats[frag.name][frag.start : frag.start + frag.numel] = values.reshape(-1).float()
        covered[frag.name] += frag.numel
    for name, flat in flats.items():
        if covered[name] != flat.numel():
            raise ValueError(f"EMA fragments of {name} cover {covered[name]} of {flat.numel()} elements")
    return {name: flat.reshape(shapes[name]) for name, flat in flats.items()}


def assemble(folder: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Full fp32 EMA weights and the update count from a checkpoint's `ema/` folder (no process group)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("rank_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no EMA files")
    pairs: list[tuple[Fragment, torch.Tensor]] = []
    updates = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            meta = _parse_metadata(f.metadata(), path)
            updates.add(meta["updates"])
            pairs += [(frag, f.get_tensor(frag.name)) for frag in meta["fragments"]]
    if len(updates) != 1:
        raise ValueError(f"{folder}: EMA files disagree on the update count {sorted(updates)}")
    return _join(pairs), updates.pop()
