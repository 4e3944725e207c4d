"""Per-rank memory of a ZeRO config at any world size: model states, buckets, frozen parts, activations.

Model states follow the ZeRO formulas with DeepSpeed's real partitioning, element for element (the same
rules tests/dist/test_profile.py checks against the engine):

- ZeRO-1/2 flatten the trained parameters, in module order, into one 16-bit buffer padded to a multiple of
  2N elements (Ψp) and give rank r the slice [r·Ψp/N, (r+1)·Ψp/N) for fp32 master weights and Adam's m, v.
  ZeRO-1 (overlap_comm off) holds every full gradient until the reduction; ZeRO-2, and ZeRO-1 with
  overlap_comm, keep the whole gradient of every parameter that overlaps its slice (a parameter cut by a partition boundary is held by both).
- ZeRO-0 (plain data parallel, DeepSpeed's FP16_Optimizer also for bf16) keeps every state whole on every
  rank, unpadded: 2Ψ + 2Ψ + 12Ψ bytes; it has no reduce buckets (the gradient all-reduce flattens them at
  the boundary, a transient while activations are already freed).
- ZeRO-3 splits every parameter into N shards of ceil(numel/N) elements; a parameter below
  stage3_param_persistence_threshold is also kept whole, in 16 bits, on every rank.

Bytes per element are the formulas' (16-bit params and grads 2, fp32 master 4, Adam 8); trials that show
another integer (an optimizer without moments, say) override it for their stage and precision, and the
override is reported. Buckets come from the config (reduce_bucket_size x 2 bytes, twice with overlap_comm
at ZeRO-1/2) plus any constant the trials show beyond it. Activations are fitted to the trials as
a + b x micro_batch (one micro-batch's saved tensors; ZeRO does not change them). Frozen encoders are
replicated per rank, as measured.

The device peak is the larger of two moments (`MemoryModel.per_rank_bytes`): the end of backward (all of the
above) and the optimizer step, where activations are gone but the step builds an fp32 copy of the rank's
gradient partition and the optimizer may allocate temporaries. The step's bytes are read from DeepSpeed
0.19.8 and torch 2.x, not fitted (see `MemoryModel.step_bytes`). A CPU trial cannot check them: sdzero's
profile (sdzero/training/measuring/probe.py) has no device allocator to read there, so its `device_peak_bytes` is the sum
of the fwd/bwd parts above (model states, buckets, frozen, one micro-batch's activations), not a
measurement of the step; only a GPU's `torch.cuda.max_memory_allocated` measures it (bench/gpu_check.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

STATE_KINDS: tuple[str, ...] = ("params", "grads", "master", "optimizer")
DEFAULT_BYTES_PER_ELEMENT: dict[str, int] = {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
"""Mixed precision with Adam: the 2 + 2 + 12 bytes per parameter of the ZeRO paper."""
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size default
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's sub_group_size default (ZeRO-3)
DEFAULT_PREFETCH_ELEMENTS = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size default
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default


# Device memory a CUDA rank holds outside what its model, buckets and activations allocate through
# PyTorch's allocator (so outside torch.cuda.max_memory_allocated, the trials' device peak), added to the
# predictions for CUDA devices (`device_overheads`). Each figure names where it comes from.
CUDA_CONTEXT_BYTES = 287_047_680
"""The CUDA context of a PyTorch process with lazy module loading (CUDA_MODULE_LOADING=LAZY, PyTorch's
default since 1.13 and CUDA's on Linux since 12.2): the figure PyTorch measured when it made lazy loading
its default (pytorch/pytorch#86509; eager loading measured 666,632,192 bytes there)."""
NCCL_BUFFSIZE_BYTES = 4 * 2**20
"""NCCL's default NCCL_BUFFSIZE, the buffer of one protocol per channel and peer (NCCL's environment-variable
documentation, "NCCL_BUFFSIZE")."""
NCCL_MAX_CHANNELS = 32
"""The channels a communicator may open (MAXCHANNELS in NCCL's src/include/device.h, NCCL 2.x), each with a
send and a receive buffer to its ring neighbours; an upper bound, as NVLink-connected H100/H200 nodes open
that many."""
NCCL_COMMUNICATORS = 1
"""NCCL communicators a ZeRO data-parallel rank creates: DeepSpeed's data-parallel group is the world group
when no model or sequence parallelism is configured (deepspeed/utils/groups.py)."""
ALLOCATOR_FRAGMENTATION = 0.05
"""PyTorch's caching allocator holds more than it hands out: blocks over 1 MiB are rounded up to 2 MiB and
carved from segments of at least 20 MiB (c10/cuda/CUDACachingAllocator.cpp, kRoundLarge, kLargeBuffer), and a
freed block can only be reused by a request that fits it. This fraction of the allocated peak is sdzero's
assumption, not a published figure; bench/gpu_first_run.py records torch.cuda.max_memory_reserved
beside max_memory_allocated for each of its rows, which measures it."""


def device_overheads(device: str, world: int, allocated_bytes: float) -> dict[str, float]:
    """Per-rank device bytes outside the allocator's peak: the CUDA context, NCCL's buffers (more than one
    rank only) and the allocator's fragmentation. None of them exist for a CPU run's trials."""
    if device != "cuda":
        return {"cuda_context": 0.0, "nccl_buffers": 0.0, "allocator_fragmentation": 0.0}
    nccl = NCCL_COMMUNICATORS * NCCL_MAX_CHANNELS * 2 * NCCL_BUFFSIZE_BYTES if world > 1 else 0
    return {
        "cuda_context": float(CUDA_CONTEXT_BYTES),
        "nccl_buffers": float(nccl),
        "allocator_fragmentation": ALLOCATOR_FRAGMENTATION * allocated_bytes,
    }


@dataclass(frozen=True)
class ZeroSettings:
    """What of the DeepSpeed JSON changes memory besides stage, precision, micro-batch and offload."""

    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    overlap_comm: bool = False
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD
    contiguous_gradients: bool = True
    """DeepSpeed's default. ZeRO-1/2 then free the reduce buckets at the end of backward
    (`_release_ipg_buffers`), before the optimizer step."""
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    """ZeRO-3 steps the optimizer one sub-group of this many elements (or just over) at a time."""
    torch_adam: bool = False
    """`"torch_adam": true` in the optimizer params: torch's AdamW/Adam instead of DeepSpeed's FusedAdam
    (on the device) or DeepSpeedCPUAdam (with optimizer offload)."""
    torch_foreach: bool | None = None
    """The optimizer params' `foreach`, passed to torch; None is torch's default (foreach on CUDA only)."""
    adam_l2: bool = False
    """torch's Adam with L2 weight decay ("type": "Adam", "adam_w_mode": false, weight_decay != 0), whose
    update adds a copy of the gradient."""
    device: str = "cuda"
    """Where the step's tensors live without offload; decides torch's foreach default."""
    prefetch_bucket_size: int = DEFAULT_PREFETCH_ELEMENTS
    """ZeRO-3: elements each parameter fetch prefetches ahead, in one coalesced all-gather (0: none)."""
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE
    """ZeRO-3: a gathered parameter used again within this many elements of traversal is kept, not
    released and gathered again (forward to backward at the turn of the step)."""
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    """ZeRO-3: the most elements gathered at once; a larger model is released and gathered again."""

    @classmethod
    def from_config(cls, config: dict[str, Any], device: str = "cuda") -> ZeroSettings:
        zero = config.get("zero_optimization", {}) or {}
        stage = int(zero.get("stage", 0))
        optimizer = config.get("optimizer", {}) or {}
        params = optimizer.get("params", {}) or {}
        foreach = params.get("foreach")
        adam_l2 = (
            str(optimizer.get("type", "")).lower() == "adam"
            and params.get("adam_w_mode", True) is False
            and float(params.get("weight_decay", 0.0)) != 0.0
        )
        return cls(
            reduce_bucket_size=int(zero.get("reduce_bucket_size", DEFAULT_BUCKET_ELEMENTS)),
            # DeepSpeed turns overlap_comm on by default at ZeRO-3 only
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            persistence_threshold=int(
                zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
            ),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            sub_group_size=int(zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)),
            torch_adam=bool(params.get("torch_adam", False)),
            torch_foreach=None if foreach is None else bool(foreach),
            adam_l2=adam_l2,
            device=device,
            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_ELEMENTS)),
            max_reuse_distance=int(zero.get("stage3_max_reuse_distance", DEFAULT_MAX_REUSE_DISTANCE)),
            max_live_parameters=int(zero.get("stage3_max_live_parameters", DEFAULT_MAX_LIVE_PARAMETERS)),
        )

    def optimizer_impl(self, offload: str) -> str:
        """Which Adam DeepSpeed 0.19.8 builds (engine.get_optimizer_configuration): torch's when
        torch_adam, else DeepSpeedCPUAdam with optimizer offload, else FusedAdam. torch's runs foreach when
        asked or, by default, when every tensor is on CUDA (`_default_to_fused_or_foreach`): offloaded
        fp32 partitions are CPU tensors, so a for-loop there."""
        if not self.torch_adam:
            return "cpu_adam" if offload != "none" else "fused"
        if self.torch_foreach is not None:
            return "torch_foreach" if self.torch_foreach else "torch_for_loop"
        on_cuda = offload == "none" and self.device == "cuda"
        return "torch_foreach" if on_cuda else "torch_for_loop"

    def optimizer_temp_elements(self, offload: str, largest_tensor: int) -> int:
        """Elements (of the fp32 optimizer dtype) the optimizer allocates at once on top of its states,
        stepping a parameter list whose largest tensor has `largest_tensor` elements. DeepSpeed hands the
        inner optimizer one flat fp32 tensor at a time (ZeRO-1/2: one param group with the rank's flat
        partition, `_optimizer_step`; ZeRO-3: one sub-group's flat partition), so per tensor list and
        per tensor are the same here.

        - FusedAdam (multi_tensor_adam.cu through multi_tensor_applier) and DeepSpeedCPUAdam (cpu_adam_impl,
          AVX tiles) update param, m and v in place: no temporary.
        - torch `_multi_tensor_adam` (foreach): `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` makes
          one new tensor per tensor in the device/dtype list, all alive together until the final
          `_foreach_addcdiv_`; the divisions and eps add run in place on it. AdamW's decoupled decay is an
          in-place `_foreach_mul_` on the params. L2 Adam makes `_foreach_add(grads, params)` (one more
          copy) but `del device_grads` frees it before the sqrt: still one tensor's worth at a time.
        - torch `_single_tensor_adam` (for-loop): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
          .add_(eps)` holds the sqrt and the quotient together for a moment: two of the tensor; L2 Adam's
          `grad.add(param)` copy lives through the iteration: three.
        """
        impl = self.optimizer_impl(offload)
        if impl == "torch_foreach":
            return largest_tensor
        if impl == "torch_for_loop":
            return (3 if self.adam_l2 else 2) * largest_tensor
        return 0


def trained_numels(model: str | Path) -> tuple[int, ...]:
    """Element counts of the trained network's parameters in module order (the UNet, or SD3's transformer),
    built on the meta device (no weights)."""
    import torch

    from sdzero.models.families import detect_family

    family = detect_family(str(model))
    cls = family.network_class()
    config = cls.load_config(str(model), subfolder=family.subfolder)
    with torch.device("meta"):
        net = cls.from_config(config)
    return tuple(int(p.numel()) for p in net.parameters() if p.requires_grad)


def state_elements(
    numels: tuple[int, ...] | np.ndarray,
    stage: int,
    world: int,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    overlap_comm: bool = False,
) -> dict[str, int]:
    """Elements of each model-state kind held by the rank that holds the most, at `world` ranks. A LoRA
    run's frozen base (advisor.model.lora_sizing) adds to the parameters only: whole below ZeRO-3."""
    sizes = np.asarray(numels, dtype=np.int64)
    psi = int(sizes.sum())
    base = np.asarray(getattr(numels, "frozen_base", ()), dtype=np.int64)
    if stage == 0:  # plain data parallel: every state whole on every rank, no flat padding
        return {"params": psi + int(base.sum()), "grads": psi, "master": psi, "optimizer": psi}
    if stage == 3:
        shard = int(np.sum(-(-sizes // world)))  # ceil per parameter
        persistent = int(sizes[sizes <= persistence_threshold].sum())  # DeepSpeed: ds_numel <= threshold
        frozen = int(np.sum(-(-base // world))) + int(base[base <= persistence_threshold].sum())
        return {"params": shard + persistent + frozen, "grads": shard, "master": shard, "optimizer": shard}
    padded = math.ceil(psi / (2 * world)) * 2 * world
    part = padded // world
    # ZeRO-1 without overlap_comm reduces at the boundary and holds every full gradient until then; with it
    # (and at ZeRO-2) gradients are reduced in backward hooks and only those overlapping the slice stay
    full = stage == 1 and not overlap_comm
    grads = psi if full else _largest_boundary_overlap(sizes, part, world)
    return {"params": padded + int(base.sum()), "grads": grads, "master": part, "optimizer": part}


def largest_sub_group(numels: tuple[int, ...] | np.ndarray, world: int, sub_group_size: int) -> int:
    """ZeRO-3: elements of the largest optimizer sub-group on a rank. DeepSpeed (stage3.py
    `_create_fp16_sub_groups`) adds parameters' partitions, in order, until the running sum reaches
    sub_group_size, so a sub-group can pass it by up to one partition."""
    shards = -(-np.asarray(numels, dtype=np.int64) // world)
    largest = running = 0
    for shard in shards.tolist():
        running += shard
        if running >= sub_group_size:
            largest, running = max(largest, running), 0
    return max(largest, running)


def _largest_boundary_overlap(sizes: np.ndarray, part: int, world: int) -> int:
    """ZeRO-2: the most gradient elements one rank keeps (whole parameters overlapping its slice)."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    lo = np.arange(world, dtype=np.int64) * part
    hi = lo + part
    first = np.searchsorted(ends, lo, side="right")  # first parameter ending after lo
    last = np.searchsorted(starts, hi, side="left") - 1  # last parameter starting before hi
    first = np.minimum(first, len(sizes) - 1)
    overlap = np.where(last >= first, ends[np.maximum(last, 0)] - starts[first], 0)
    return int(overlap.max())


@dataclass
class ActivationFit:
    """activation_bytes = intercept + slope x micro_batch, least squares over the trials given."""

    intercept: float
    slope: float

    def predict(self, micro_batch: float) -> float:
        return max(self.intercept + self.slope * micro_batch, 0.0)

    @classmethod
    def fit(cls, micro_batch: np.ndarray, activation_bytes: np.ndarray) -> ActivationFit:
        mb = np.asarray(micro_batch, dtype=float)
        act = np.asarray(activation_bytes, dtype=float)
        if len(np.unique(mb)) < 2:  # one micro-batch: proportional, the autotuner's own assumption
            return cls(0.0, float(np.mean(act / mb)))
        slope, intercept = np.polyfit(mb, act, 1)
        return cls(float(intercept), float(slope))


@dataclass
class MemoryModel:
    numels: tuple[int, ...]
    zero: ZeroSettings
    frozen_bytes: float
    activations: ActivationFit
    bytes_per_element: dict[tuple[int, str, str], int] = field(default_factory=dict)
    """(stage, precision, kind) -> bytes, where trials showed other than DEFAULT_BYTES_PER_ELEMENT."""
    bucket_extra_bytes: dict[int, float] = field(default_factory=dict)
    """Per stage: measured bucket bytes beyond the config's (ZeRO-3's bucket also holds its last params)."""
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    """The device the predictions are for: "cuda" adds the device overheads (`device_overheads`) to what
    must fit. `fit_memory_model` reads it from the trials (a CUDA allocator peak in `cuda_peak_bytes`)."""
    checkpointed: ActivationFit | None = None
    """Activations with gradient checkpointing, fitted to its trials (advisor.model.recompute); None: no
    trial ran with it, and a checkpointed config is taken to need `activations`."""

    @property
    def psi(self) -> int:
        return sum(self.numels)

    def element_bytes(self, stage: int, precision: str, kind: str) -> int:
        return self.bytes_per_element.get((stage, precision, kind), DEFAULT_BYTES_PER_ELEMENT[kind])

    def state_bytes(self, stage: int, precision: str, world: int) -> dict[str, int]:
        elements = state_elements(
            self.numels, stage, world, self.zero.persistence_threshold, self.zero.overlap_comm
        )
        return {k: elements[k] * self.element_bytes(stage, precision, k) for k in STATE_KINDS}

    def bucket_bytes(self, stage: int) -> float:
        if stage == 0:  # no reduce buckets: the all-reduce flattens gradients at the boundary (a transient)
            return self.bucket_extra_bytes.get(stage, 0.0)
        copies = 2 if stage in (1, 2) and self.zero.overlap_comm else 1
        return copies * 2 * self.zero.reduce_bucket_size + self.bucket_extra_bytes.get(stage, 0.0)

    def activation_bytes(self, micro_batch: int, checkpointing: bool = False) -> float:
        """One micro-batch's saved activations, with or without recomputation."""
        fit = self.checkpointed if checkpointing and self.checkpointed is not None else self.activations
        return fit.predict(micro_batch)

    def step_bytes(self, stage: int, precision: str, offload: str, world: int) -> dict[str, float]:
        """Bytes at the optimizer step (activations freed), read from DeepSpeed 0.19.8's step().

        ZeRO-1/2 without offload (stage_1_and_2.py `step`), per param group (sdzero passes one):
        `free_grad_in_param_list(params_not_in_partition)` first frees the gradients outside the rank's
        slice (ZeRO-1 held them all until here), then `flat_grad_partition = flatten(averaged_gradients)`
        copies the slice's 16-bit gradients into a new flat tensor (part elements) while
        `averaged_gradients` still holds their views into `grads_in_partition` (the gradient state, whole
        parameters overlapping the slice), and `.to(fp32)` makes the fp32 gradient (part elements) with
        both alive: cast = G_overlap·2 + part·2 + part·4 bytes. Then the 16-bit copies are dropped
        (`del flat_grad_partition`, `averaged_gradients[i] = None`) and the optimizer steps the fp32
        master with that fp32 gradient: update = part·4 + optimizer temporaries. The reduce buckets were
        already released at the end of backward when contiguous_gradients is on.
        transient = max(cast, update); resident = 16-bit params + fp32 master + Adam + frozen.

        ZeRO-3 without offload (stage3.py `step`): per sub-group s, `_prepare_fp32_grad_for_sub_group`
        does `flatten(averaged_gradients[s]).to(fp32)` (2s + 4s bytes alive together), the flat 16-bit
        copy is dropped, the optimizer steps (4s + temporaries) and `_release_sub_group` frees the fp32
        gradient before the next sub-group. The 16-bit gradient partition buffer and the bucket stay
        allocated: resident = all model states + buckets + frozen.

        Optimizer offload: the fp32 gradients are made on the host during backward (ZeRO-1/2
        `async_inplace_copy_grad_to_fp32_buffer_from_gpu`; ZeRO-3 skips the device fp32 gradient) and the
        optimizer steps host tensors, so the device adds nothing at the step; its only transient is the
        optimizer's, in host memory (`host_transient`).

        fp16 and bf16 are the same here: fp32 master and fp32 gradient copies either way (fp16's unscale
        and clip are in place on the fp32 copy). Not modelled: bf16 ZeRO-1 with `data_types.grad_accum_dtype`
        fp32 (DeepSpeed's BF16_Optimizer instead) and more than one param group.
        """
        states = self.state_bytes(stage, precision, world)
        elements = state_elements(
            self.numels, stage, world, self.zero.persistence_threshold, self.zero.overlap_comm
        )
        half = self.element_bytes(stage, precision, "grads")
        full = self.element_bytes(stage, precision, "master")
        if stage == 3:
            flat = largest_sub_group(self.numels, world, self.zero.sub_group_size)
            resident_kinds = STATE_KINDS
            resident_extra = self.bucket_bytes(stage)
            kept_grads = 0.0  # already counted in the resident states
        else:
            flat = elements["master"]  # the rank's flat fp32 partition
            resident_kinds = ("params", "master", "optimizer")
            resident_extra = 0.0 if self.zero.contiguous_gradients else self.bucket_bytes(stage)
            # ZeRO-0 flattens every 16-bit gradient (FP16_Optimizer's step); ZeRO-1/2 those of the slice
            overlap = state_elements(self.numels, 2, world, self.zero.persistence_threshold, True)["grads"]
            kept_grads = float((self.psi if stage == 0 else overlap) * half)
        offloaded = 0.0
        if offload != "none":
            offloaded += states["master"] + states["optimizer"]
        if offload == "optimizer+params":
            offloaded += states["params"]
        resident = (
            float(sum(states[k] for k in resident_kinds)) - offloaded + resident_extra + self.frozen_bytes
        )
        temp = float(self.zero.optimizer_temp_elements(offload, flat) * full)
        if offload != "none":
            return {"resident": resident, "transient": 0.0, "total": resident, "host_transient": temp}
        # ZeRO-0 (FP16_Optimizer.step): each gradient cast to fp32 (`p.grad.to(fp32)`), then flattened into
        # one fp32 tensor, with the 16-bit gradients still alive; ZeRO-1/2/3 flatten in 16 bits, then cast
        cast = kept_grads + flat * (full if stage == 0 else half) + flat * full
        update = flat * full + temp
        transient = max(cast, update)
        return {
            "resident": resident,
            "transient": transient,
            "total": resident + transient,
            "host_transient": 0.0,
        }

    def per_rank_bytes(
        self,
        stage: int,
        precision: str,
        micro_batch: int,
        offload: str,
        world: int,
        checkpointing: bool = False,
    ) -> dict[str, float]:
        """Device bytes per rank by part; `allocated` is the allocator's peak (offloaded states excluded):
        the larger of the end of backward (`fwd_bwd`: model states, buckets, frozen, activations) and the
        optimizer step (`step`, see `step_bytes`). `total`, what must fit, adds on CUDA the CUDA context,
        NCCL's buffers and the allocator's fragmentation (`device_overheads`). `step_host_transient` is host
        memory, in neither."""
        states = self.state_bytes(stage, precision, world)
        offloaded = 0
        if offload != "none":  # CPU offload moves fp32 master weights and Adam's moments off the device
            offloaded += states["master"] + states["optimizer"]
        if offload == "optimizer+params":
            offloaded += states["params"]
        parts = {
            "model_states": float(sum(states.values()) - offloaded),
            "buckets": self.bucket_bytes(stage),
            "frozen": self.frozen_bytes,
            "activations": self.activation_bytes(micro_batch, checkpointing),
        }
        fwd_bwd = sum(parts.values())
        step = self.step_bytes(stage, precision, offload, world)
        allocated = max(fwd_bwd, step["total"])
        overheads = device_overheads(self.device, world, allocated)
        return {
            **parts,
            "fwd_bwd": fwd_bwd,
            "step": step["total"],
            "step_transient": step["transient"],
            "step_host_transient": step["host_transient"],
            "allocated": allocated,
            **overheads,
            "total": allocated + sum(overheads.values()),
            "offloaded": float(offloaded),
        }


def fit_memory_model(trials: pd.DataFrame, numels: tuple[int, ...], zero: ZeroSettings) -> MemoryModel:
    """Fit activations and calibrate bytes per element and buckets on the ok trials given."""
    ok = trials[trials["status"] == "ok"]
    if ok.empty:
        raise ValueError("no successful trial to fit the memory model on")
    on_cuda = "cuda_peak_bytes" in ok and bool(
        pd.to_numeric(ok["cuda_peak_bytes"], errors="coerce").notna().any()
    )
    model = MemoryModel(
        numels,
        zero,
        float(ok["frozen_bytes"].median()),
        ActivationFit.fit(ok["micro_batch"].to_numpy(), ok["activation_bytes"].to_numpy()),
        device="cuda" if on_cuda else "cpu",
    )
    for (stage, precision), rows in ok.groupby(["zero_stage", "precision"]):
        row = rows.iloc[0]
        elements = state_elements(
            numels, int(stage), int(row["world_size"]), zero.persistence_threshold, zero.overlap_comm
        )
        for kind in STATE_KINDS:
            measured = int(row[f"{kind}_bytes"])
            per, rest = divmod(measured, max(elements[kind], 1))
            if rest == 0 and per != DEFAULT_BYTES_PER_ELEMENT[kind]:
                model.bytes_per_element[(int(stage), str(precision), kind)] = per
                model.notes.append(f"ZeRO-{stage} {precision}: {kind} measured at {per} bytes per element")
            elif rest:
                model.notes.append(
                    f"ZeRO-{stage} {precision}: {kind} measured {measured} bytes, not a whole "
                    f"number of bytes per element of the formula's {elements[kind]}"
                )
        model.bucket_extra_bytes.pop(int(stage), None)  # measured against the config's bytes alone
        model.bucket_extra_bytes[int(stage)] = float(rows["bucket_bytes"].median()) - model.bucket_bytes(
            int(stage)
        )
    return model
