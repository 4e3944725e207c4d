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


def apply_backend_flags(cfg: Any, device_type: str) -> None:
    """Process-wide torch switches: TF32 for fp32 matmuls (cuBLAS) and convolutions (cuDNN). Left alone
    off CUDA: the matmul flag also sets torch's global float32_matmul_precision, which CPU backends read."""
    if device_type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)


def _channels_last_input(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the latents (`sample`, the first argument) as NHWC. Convolutions then run NHWC
    (cuDNN follows the input's layout), and the ops after them keep it."""
    if kwargs.get("sample") is not None:
        kwargs = {**kwargs, "sample": kwargs["sample"].contiguous(memory_format=torch.channels_last)}
    elif args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        args = (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
    return args, kwargs


def prepare_network(cfg: Any, module: torch.nn.Module) -> list[Any]:
    """Hooks on the trained network for `--channels-last` and `--attention`; returns their handles.

    Channels-last is applied to the activations, not by `module.to(memory_format=...)`: ZeRO keeps the
    weights as views into flat buffers that it lays out contiguously (NCHW), and replacing a weight's storage
    after `deepspeed.initialize` would cut it off from the buffer the optimizer updates. cuDNN converts the
    (small) weights per call; the activations, the large tensors, stay NHWC.
    """
    handles = []
    if cfg.channels_last:
        handles.append(module.register_forward_pre_hook(_channels_last_input, with_kwargs=True))
    if cfg.attention != "auto":
        from torch.nn.attention import sdpa_kernel

        state: dict[str, Any] = {}

        def enter(_module: Any, _args: Any) -> None:
            state["ctx"] = sdpa_kernel([_backend(cfg.attention)])
            state["ctx"].__enter__()

        def leave(_module: Any, _args: Any, _output: Any) -> None:
            state.pop("ctx").__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
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
    dims = set()
    for m in module.modules():
        heads, to_q = getattr(m, "heads", None), getattr(m, "to_q", None)
        if isinstance(heads, int) and heads > 0 and isinstance(to_q, torch.nn.Linear):
            dims.add(to_q.out_features // heads)
    return sorted(dims)


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
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "channels_last": bool(cfg.channels_last),
        "compiled": bool(getattr(engine, "is_compiled", False)),
        "attention_requested": cfg.attention,
        "attention_kernel_by_head_size": attention,
        "attention_processors": processors,
        "optimizer": optimizer_implementation(engine.optimizer),
    }
