"""Which Adam kernel a DeepSpeed `optimizer` section gets on CUDA: DeepSpeed's FusedAdam where it can be
built, torch's fused AdamW otherwise.

FusedAdam is a just-in-time CUDA op: DeepSpeed compiles it with nvcc at the first `deepspeed.initialize`
unless the wheel was built with it (`DS_BUILD_FUSED_ADAM=1`), and its op builder refuses an nvcc whose
CUDA release differs from the one torch was built with (deepspeed/ops/op_builder/builder.py,
`assert_no_cuda_mismatch`). A machine with CUDA torch and no toolkit (or another one) then fails at the
first step. There the section's Adam/AdamW runs as torch's fused AdamW through DeepSpeed's own
`torch_adam` switch: the same update rule and hyperparameters, one kernel launch per parameter group.
"""

from __future__ import annotations

import json
from typing import Any

ADAM_TYPES = {"adam", "adamw"}
"""DeepSpeed optimizer types (lower case) that FusedAdam would serve on CUDA."""


def fused_adam_unavailable() -> str | None:
    """Why FusedAdam cannot be built or loaded on this CUDA machine, or None when it can: a wheel with the op
    prebuilt, or an nvcc whose release DeepSpeed's builder accepts for torch's CUDA."""
    import torch

    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("fused_adam"):
            return None  # compiled into the DeepSpeed wheel: no nvcc needed
    except ImportError:
        pass
    from deepspeed.ops.op_builder.builder import assert_no_cuda_mismatch, installed_cuda_version

    try:
        major, minor = installed_cuda_version()
    except Exception as exc:  # MissingCUDAException: no CUDA_HOME, or no nvcc under it
        return f"no CUDA toolkit with nvcc ({str(exc).splitlines()[0]})"
    try:
        assert_no_cuda_mismatch()
    except Exception:  # CUDAMismatchException
        return f"nvcc is CUDA {major}.{minor}, torch is built for CUDA {torch.version.cuda}"
    return None


def uses_fused_adam(config: dict[str, Any], device_type: str) -> bool:
    """Whether DeepSpeed would build FusedAdam for this JSON on this device: an Adam/AdamW section on CUDA,
    no optimizer offload (that runs DeepSpeedCPUAdam) and no `torch_adam` of the user's."""
    section = config.get("optimizer") or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return (
        device_type == "cuda"
        and str(section.get("type", "")).lower() in ADAM_TYPES
        and offload.get("device", "none") in (None, "none")
        and "torch_adam" not in (section.get("params") or {})
    )


def choose_adam(config: dict[str, Any], device_type: str) -> tuple[dict[str, Any], str | None]:
    """(the JSON to hand DeepSpeed, one line to log or None). Where FusedAdam cannot be built, the Adam
    section gets `torch_adam` and `fused`: torch's fused AdamW with the section's own hyperparameters."""
    if not uses_fused_adam(config, device_type):
        return config, None
    why = fused_adam_unavailable()
    if why is None:
        return config, None
    out = json.loads(json.dumps(config))
    out["optimizer"].setdefault("params", {}).update(torch_adam=True, fused=True)
    return out, f"optimizer: torch's fused AdamW instead of DeepSpeed's FusedAdam: {why}"


def prebuild() -> str:
    """`make venv`: build the Adam ops the trainer may use once, outside any timed job, and say what was
    skipped. FusedAdam only where it can be built (see fused_adam_unavailable); CPU Adam (optimizer
    offload) and, on CPUs, the shared-memory collectives always."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    params = [torch.nn.Parameter(torch.zeros(1))]
    accelerator = get_accelerator()
    why = fused_adam_unavailable() if accelerator.device_name() == "cuda" else None
    if why is None:
        FusedAdam(params)
    DeepSpeedCPUAdam(params)
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load()
    if why is not None:
        return f"FusedAdam not built ({why}): runs use torch's fused AdamW for DeepSpeed's Adam sections"
    return "DeepSpeed's Adam ops are built"


if __name__ == "__main__":  # `python -m` imports sdzero first, which points JIT builds at the venv
    print(prebuild())
