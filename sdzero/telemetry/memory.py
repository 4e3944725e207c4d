"""What a rank holds in memory, measured for `sdzero profile` (sdzero.training.measuring.probe's Probe reads these).

- Model states, by kind (16-bit parameters, gradients, fp32 master weights, optimizer states; gradient
  buckets apart), read from the engine as the storages that hold them, so padding counts and views count once;
- activations: the storages autograd saves during one forward of the trained network (`ActivationMeter`);
- frozen modules, peak RSS and the CUDA allocator's peak.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

STATE_KINDS = ("params", "grads", "master", "optimizer")
"""Model states, in the order the ZeRO paper counts them: 2Ψ + 2Ψ + KΨ with K = 12 for Adam."""

# Where DeepSpeed's ZeRO optimizers (0.16 .. 0.19) keep gradients besides `param.grad`: stage 1/2 keep the
# rank's reduced partition in `averaged_gradients` (or `grads_in_partition` with contiguous gradients),
# stage 3 in one flat `grad_partitions_flat_buffer`. Internal names, so a missing one is skipped, not an error.
_GRAD_ATTRS = ("grads_in_partition", "averaged_gradients", "grad_partitions_flat_buffer")
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
# Communication buckets: gradients pass through them on the way to a reduce; not model states.
_BUCKET_ATTRS = ("ipg_buckets", "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer")


# --------------------------------------------------------------------------------------------------
# Memory: storages held, deduplicated (views of one flat buffer count once, padding included)


def _tensors(node: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested lists, tuples, dicts and dataclass-like objects (DeepSpeed's buckets)."""
    if depth > 4 or node is None:
        return
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _tensors(value, depth + 1)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _tensors(value, depth + 1)
    elif hasattr(node, "__dataclass_fields__"):
        for name in node.__dataclass_fields__:
            yield from _tensors(getattr(node, name, None), depth + 1)


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[tuple[str, int]]) -> tuple[int, int]:
    """(bytes, of which off the compute device) of the storages behind `tensors` not yet in `seen`.

    Counting storages, not tensor sizes, gives what the allocator really holds: ZeRO keeps parameters,
    gradients and master weights as views into flat buffers padded for alignment, and a view's own numel
    would miss that padding.
    """
    total = offloaded = 0
    compute = compute_device_type()
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue  # a ZeRO-3 placeholder (its data lives in ds_tensor) or an empty tensor
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
        if t.device.type != compute:
            offloaded += storage.nbytes()
    return total, offloaded


def compute_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _module_param_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    for p in module.parameters():
        # ZeRO-3: `ds_tensor` is this rank's shard; `p.data` is empty unless the parameter is persistent
        # (below stage3_param_persistence_threshold, kept whole on every rank) or gathered right now.
        # A gathered non-persistent parameter is ZeRO-3's working set, not a model state: left out.
        shard = getattr(p, "ds_tensor", None)
        if shard is None:
            yield p.data
            continue
        yield shard
        if getattr(p, "ds_persist", False):
            yield p.data


def trained_param_count(module: torch.nn.Module) -> int:
    """Ψ: the trained network's parameter count (ZeRO-3 knows the full size as `ds_numel`)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad)


def model_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of model states this rank holds, by kind, read from the engine.

    A storage counts once, in the first kind that reaches it, in this order: `buckets` (ZeRO's reduce
    buckets: gradients pass through them, so a gradient that is a view into one is counted there, not as a
    gradient), `params` (the module's 16-bit weights or, under ZeRO-3, their shards), `master` (fp32
    master partitions), `optimizer` (the inner optimizer's state: Adam's m and v), `grads` (`param.grad`
    and ZeRO's gradient partitions). `offloaded` says how many of these bytes live off the compute device
    (CPU offload on a GPU machine).
    """
    seen: set[tuple[str, int]] = set()
    zero_opt = engine.optimizer
    inner = getattr(zero_opt, "optimizer", zero_opt)
    # fp32 master partitions: the inner optimizer's state keys and parameters (ZeRO-3 swaps them into its
    # param_groups only while stepping, so its flat partitions are read by name too)
    masters = [*inner.state.keys(), *(p for group in inner.param_groups for p in group["params"])]
    # `grad_accum`: where ZeRO-1 accumulates when the accumulation dtype differs from the weights' dtype
    grads = [g for p in engine.module.parameters() for g in (p.grad, getattr(p, "grad_accum", None))]
    sources: dict[str, list[torch.Tensor]] = {
        "buckets": [t for name in _BUCKET_ATTRS for t in _tensors(getattr(zero_opt, name, None))],
        "params": list(_module_param_tensors(engine.module)),
        "master": masters + [t for name in _MASTER_ATTRS for t in _tensors(getattr(zero_opt, name, None))],
        "optimizer": [t for state in inner.state.values() for t in _tensors(state)],
        "grads": grads + [t for name in _GRAD_ATTRS for t in _tensors(getattr(zero_opt, name, None))],
    }
    out = {"offloaded": 0}
    for kind, tensors in sources.items():
        out[kind], offloaded = storage_bytes(tensors, seen)
        out["offloaded"] += offloaded
    return {k: out[k] for k in (*STATE_KINDS, "buckets", "offloaded")}


def module_bytes(*modules: torch.nn.Module) -> int:
    """Parameter and buffer bytes of frozen modules (VAE, text encoder), replicated on every rank."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for m in modules:
        total += storage_bytes([*m.parameters(), *m.buffers()], seen)[0]
    return total


def peak_rss_bytes() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(kib if sys.platform == "darwin" else kib * 1024)


def cuda_peak_bytes() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


class ActivationMeter:
    """Bytes autograd saves for backward during one forward of `module`: the activation memory.

    A saved-tensor pack hook sees every tensor saved for backward. Parameters (and views of them, such as a
    transposed weight) are model states, not activations, and are skipped; storages count once.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self._seen: set[tuple[str, int]] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
            added, _ = storage_bytes([t], self._seen)
            if added:
                self.bytes += added
                self.tensors += 1
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
