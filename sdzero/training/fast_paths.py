"""The GPU fast paths as run options: TF32, channels-last, torch.compile, the attention kernel, the optimizer.

Each is an option with a default that is safe everywhere, and what a run really used is written to
`environment.json` (`speed`), read from the objects themselves (the torch flags, the engine, the optimizer
class, an SDPA probe), not from the options. docs/gpu.md says what each does and how to measure it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from sdzero.config.options import ATTENTION_BACKENDS  # declared with the other options
from sdzero.errors import UserError


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def check_speed_options(cfg: Any, ds: Any) -> None:
    """Refuse, before any process group exists, what DeepSpeed's compile does not support."""
    if cfg.attention not in ATTENTION_BACKENDS:
        raise UserError(f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {cfg.attention!r}")
    if cfg.compile and ds.offload_param:
        # DeepSpeed tests engine.compile with ZeRO 1-3 and optimizer offload (cpu/nvme), never with
        # ZeRO-3 parameter offload, whose fetch hooks move weights while the graph runs.
        raise UserError(
            f"--compile with offload_param ({ds.path}): DeepSpeed's compile does not support ZeRO-3 parameter "
            "offload; drop --compile or the offload_param section"
        )


def _has_fp32_precision_api() -> bool:
    """torch >= 2.9's per-backend `fp32_precision` settings. Once they are set, reading a legacy flag
    (`allow_tf32`, `get_float32_matmul_precision`) raises, so a process uses one API throughout."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(
        getattr(torch.backends.cudnn, "conv", None), "fp32_precision"
    )


def apply_backend_flags(cfg: Any, device_type: str) -> None:
    """Process-wide torch switches: TF32 for fp32 matmuls (cuBLAS) and convolutions (cuDNN), through the
    `fp32_precision` API where torch has it, the legacy flags otherwise. Left alone off CUDA: the matmul
    setting also sets torch's global float32_matmul_precision, which CPU backends read."""
    if device_type != "cuda":
        return
    if _has_fp32_precision_api():
        precision = "tf32" if cfg.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
        return
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)


def tf32_in_use() -> tuple[bool, bool]:
    """(fp32 matmuls, fp32 convolutions) may run as TF32, read through the API the process sets them with:
    the new one where torch has it (its "none" inherits the global setting), the legacy flags otherwise."""
    if not _has_fp32_precision_api():
        return bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32)

    def resolved(value: str) -> bool:
        return (torch.backends.fp32_precision if value == "none" else value) == "tf32"

    return (
        resolved(torch.backends.cuda.matmul.fp32_precision),
        resolved(torch.backends.cudnn.conv.fp32_precision),
    )


def _channels_last_input(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the latents (`sample`, the first argument) as NHWC. Convolutions then run NHWC
    (cuDNN follows the input's layout), and the ops after them keep it."""
    if kwargs.get("sample") is not None:
        kwargs = {**kwargs, "sample": kwargs["sample"].contiguous(memory_format=torch.channels_last)}
    elif args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        args = (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
    return args, kwargs


def attention_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The network's diffusers Attention blocks: a head count and a `to_q` projection (any family)."""
    return [
        m
        for m in module.modules()
        if isinstance(getattr(m, "heads", None), int)
        and isinstance(getattr(m, "to_q", None), torch.nn.Linear)
    ]


def prepare_network(cfg: Any, module: torch.nn.Module) -> list[Any]:
    """Hooks on the trained network for `--channels-last` and `--attention`; returns their handles.

    Channels-last is applied to the activations, not by `module.to(memory_format=...)`: ZeRO keeps the
    weights as views into flat buffers that it lays out contiguously (NCHW), and replacing a weight's storage
    after `deepspeed.initialize` would cut it off from the buffer the optimizer updates. cuDNN converts the
    (small) weights per call; the activations, the large tensors, stay NHWC.

    The attention kernel is set around each Attention block's own forward, not the whole network's:
    gradient checkpointing recomputes a block's forward during backward, outside the network's forward, and
    the recomputation must run the same kernel (another kernel saves other tensors, and PyTorch's
    checkpoint raises CheckpointError). A block's hooks run on every call, the recomputation's included.
    """
    handles = []
    if cfg.channels_last:
        handles.append(module.register_forward_pre_hook(_channels_last_input, with_kwargs=True))
    if cfg.attention != "auto":
        from torch.nn.attention import sdpa_kernel

        backend = _backend(cfg.attention)
        for block in attention_modules(module):
            entered: list[Any] = []  # a stack: a block's forward never re-enters itself, but be exact

            def enter(_module: Any, _args: Any, entered: list[Any] = entered) -> None:
                entered.append(sdpa_kernel([backend]))
                entered[-1].__enter__()

            def leave(_module: Any, _args: Any, _output: Any, entered: list[Any] = entered) -> None:
                entered.pop().__exit__(None, None, None)

            handles += [
                block.register_forward_pre_hook(enter),
                block.register_forward_hook(leave, always_call=True),
            ]
    return handles


def compile_engine(cfg: Any, engine: Any) -> None:
    """`--compile`: DeepSpeed's engine.compile, which compiles the module in place (`module.compile`), so
    parameter names, checkpoints and exports are those of the plain module."""
    if cfg.compile:
        from deepspeed.accelerator import get_accelerator

        engine.compile(backend=get_accelerator().get_compile_backend())


def adamw_options(device_type: str) -> dict[str, Any]:
    """sdzero's own AdamW (when the DeepSpeed JSON has no optimizer section): the fused kernel on CUDA (one
    launch per parameter group instead of one per tensor per op); elsewhere torch's default."""
    return {"fused": True} if device_type == "cuda" else {}


def optimizer_implementation(optimizer: Any) -> str:
    """What really steps: the innermost optimizer under DeepSpeed's wrappers, with torch's fused/foreach flag."""
    inner = optimizer
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    cls = type(inner)
    name = f"{cls.__module__.split('.')[0]}.{cls.__name__}"
    if isinstance(inner, torch.optim.Optimizer) and cls.__module__.startswith("torch."):
        defaults = inner.defaults
        impl = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "default"
        return f"{name} ({impl})"
    return name


def attention_head_dims(module: torch.nn.Module) -> list[int]:
    """Head sizes of the network's diffusers Attention blocks (what decides which SDPA kernels can run)."""
    return sorted({m.to_q.out_features // m.heads for m in attention_modules(module) if m.heads > 0})


def sdpa_backend_for(head_dim: int, dtype: torch.dtype, device: torch.device, requested: str) -> str | None:
    """The SDPA kernel a call of this head size and dtype runs: the first of PyTorch's priority order that
    the requested set allows and that runs on a small probe. None: no allowed kernel runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {_backend(n): n for n in ATTENTION_BACKENDS if n != "auto"}
    by_value = {int(b.value): b for b in SDPBackend.__members__.values()}
    order = [by_value[v] for v in torch._C._get_sdp_priority_order() if v in by_value]
    allowed = [b for b in order if b in names and (requested == "auto" or names[b] == requested)]
    q = torch.ones(1, 2, 64, head_dim, dtype=dtype, device=device)  # not randn: the run's RNG stays untouched
    for backend in allowed:
        with contextlib.suppress(RuntimeError), sdpa_kernel([backend]), torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
            return names[backend]
    return None


def check_attention(cfg: Any, module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> dict:
    """{head size: kernel} for the trained network; a requested kernel that cannot run is refused."""
    found = {str(d): sdpa_backend_for(d, dtype, device, cfg.attention) for d in attention_head_dims(module)}
    bad = [d for d, kernel in found.items() if kernel is None]
    if bad:
        raise UserError(
            f"--attention {cfg.attention}: that SDPA kernel cannot run here for head size {', '.join(bad)} in "
            f"{dtype} on {device.type}; use --attention auto (or flash/math on a CPU)"
        )
    return found


def speed_report(cfg: Any, engine: Any, timing: str, attention: dict) -> dict[str, Any]:
    """What the run used, for environment.json: read from torch, the engine and the optimizer."""
    processors = sorted({type(p).__name__ for p in getattr(engine.module, "attn_processors", {}).values()})
    return {
        "timing": timing,
        "tf32_matmul": tf32_in_use()[0],
        "tf32_cudnn": tf32_in_use()[1],
        "channels_last": bool(cfg.channels_last),
        "compiled": bool(getattr(engine, "is_compiled", False)),
        "attention_requested": cfg.attention,
        "attention_kernel_by_head_size": attention,
        "attention_processors": processors,
        "optimizer": optimizer_implementation(engine.optimizer),
    }
