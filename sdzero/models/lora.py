"""LoRA adapters on the trained network (the UNet, or SD3's MMDiT), through peft.

`add_lora` freezes the network and injects peft's LoRA layers (diffusers' `add_adapter`, as its LoRA scripts
do): afterwards the only parameters with `requires_grad` are the adapters', so the engine hands only them
to DeepSpeed's optimizer (sdzero.training.engine), and ZeRO partitions only their gradients and optimizer
states. The frozen base stays in the module: replicated at ZeRO 0-2, partitioned with the rest at ZeRO-3
(its parameters are gathered in each forward like a full fine-tune's).

Under ZeRO-3 the module's parameters are placeholders outside a gather, and `state_dict()` of them holds
zero-element tensors: saving that is how other tools write empty adapters (peft#2500, accelerate#3508).
`gathered_adapter` gathers the adapters (small: a few MB) around the read, and `adapter_problem` refuses
an adapter with a missing, empty or mis-sized tensor before anything is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdzero.errors import UserError
from sdzero.models.families import Family

ADAPTER_NAME = "default"
"""peft's adapter name in the module's parameter names (`...to_q.lora_A.default.weight`)."""
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""diffusers' file name for LoRA weights: what `pipeline.load_lora_weights(folder)` reads."""
LORA_EMA_WEIGHTS = "pytorch_lora_weights_ema.safetensors"
"""The EMA of the adapters beside it (`load_lora_weights(folder, weight_name=LORA_EMA_WEIGHTS)`)."""


@dataclass(frozen=True)
class LoraSettings:
    """What the LoRA options resolve to for one family (defaults as diffusers' LoRA scripts)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @classmethod
    def of(cls, cfg: Any, family: Family) -> LoraSettings | None:
        """The run's settings, None without --lora-rank (a full fine-tune)."""
        if getattr(cfg, "lora_rank", None) is None:
            return None
        alpha = cfg.lora_alpha if cfg.lora_alpha is not None else float(cfg.lora_rank)
        targets = tuple(cfg.lora_target_modules) or family.lora_targets
        return cls(int(cfg.lora_rank), float(alpha), float(cfg.lora_dropout), targets)

    @classmethod
    def from_identity(cls, objective: dict[str, Any]) -> LoraSettings:
        """The settings a checkpoint was trained with, from its manifest's identity (`identity`)."""
        return cls(
            rank=int(objective["--lora-rank"]),
            alpha=float(objective["--lora-alpha"]),
            dropout=float(objective["--lora-dropout"]),
            targets=tuple(objective["--lora-target-modules"]),
        )

    def peft_config(self) -> Any:
        from peft import LoraConfig

        # gaussian A, zero B (the scripts' init): the adapted network starts equal to the base.
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            init_lora_weights="gaussian",
            target_modules=list(self.targets),
        )

    def identity(self) -> dict[str, Any]:
        """Keyed by flag, for the run identity (a resume must keep every one)."""
        return {
            "--lora-rank": self.rank,
            "--lora-alpha": self.alpha,
            "--lora-dropout": self.dropout,
            "--lora-target-modules": list(self.targets),
        }


def matches(name: str, target: str) -> bool:
    """peft's rule for a target given by name: the module's full name, or a suffix of it at a dot."""
    return name == target or name.endswith("." + target)


def check_targets(settings: LoraSettings, modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Every target names at least one Linear or Conv layer of the network: a typo would otherwise train
    nothing where the user meant something (peft only fails when no target matches at all)."""
    layers = [n for n, m in modules if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    unknown = [t for t in settings.targets if not any(matches(n, t) for n in layers)]
    if unknown:
        seen = sorted({n.rsplit(".", 1)[-1] for n in layers if "attn" in n or "proj" in n})[:8]
        raise UserError(
            f"--lora-target-modules: {', '.join(unknown)} matches no Linear/Conv layer of the network; give "
            f"module names or suffixes such as {' '.join(seen)}"
        )


def check_targets_on_model(cfg: Any, family: Family) -> None:
    """The targets against the network built from its config on the meta device (no weights, no memory),
    before any process group exists."""
    settings = LoraSettings.of(cfg, family)
    if settings is None:
        return
    cls = family.network_class()
    config = cls.load_config(str(cfg.model), subfolder=family.subfolder)
    with torch.device("meta"):
        network = cls.from_config(config)
    check_targets(settings, network.named_modules())


def add_lora(network: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Freeze `network` and give it LoRA adapters (in place); only the adapters require grad after it."""
    network.requires_grad_(False)
    network.add_adapter(settings.peft_config(), adapter_name=ADAPTER_NAME)
    for name, param in network.named_parameters():
        param.requires_grad_(".lora_" in name)
    return network


def is_lora(network: torch.nn.Module) -> bool:
    return bool(getattr(network, "peft_config", None))


def adapter_key(name: str) -> str:
    """A module parameter name as peft's state dict names it (without the adapter name)."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def expected_adapter(network: torch.nn.Module) -> dict[str, int]:
    """{key: elements} of every adapter tensor the network trains (ZeRO-3 knows the full size as
    `ds_numel`): what a saved adapter must hold."""
    return {
        adapter_key(n): int(getattr(p, "ds_numel", p.numel()))
        for n, p in network.named_parameters()
        if p.requires_grad
    }


def adapter_state(network: torch.nn.Module, params: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """peft's state dict of the adapter: from `params` (module parameter names, e.g. an EMA), else from
    the module's own parameters as they are now (under ZeRO-3 only inside a gather)."""
    from peft.utils import get_peft_model_state_dict

    if params is None:
        params = {n: p.detach() for n, p in network.named_parameters() if p.requires_grad}
    state = get_peft_model_state_dict(network, state_dict=params, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}


def gathered_adapter(engine: Any) -> dict[str, torch.Tensor] | None:
    """The whole adapter on rank 0 (None elsewhere). A collective under ZeRO-3: every rank must call it.
    Gathers the adapter parameters only, never the frozen base."""
    import torch.distributed as dist

    module = engine.module
    trained = [p for p in module.parameters() if p.requires_grad]
    gather: Any = contextlib.nullcontext()
    if engine.zero_optimization_partition_weights():
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(trained, modifier_rank=None)
    with gather:
        return adapter_state(module) if dist.get_rank() == 0 else None


def adapter_problem(state: dict[str, torch.Tensor], expected: dict[str, int]) -> str | None:
    """One line naming what is wrong with an adapter about to be written, None when it is whole."""
    if not expected:
        return "the network has no LoRA adapter to save (no parameter requires grad)"
    missing = sorted(set(expected) - set(state))
    empty = sorted(k for k, v in state.items() if v.numel() == 0)
    short = sorted(k for k, v in state.items() if v.numel() and k in expected and v.numel() != expected[k])
    for what, keys in (("missing", missing), ("empty (0 elements)", empty), ("partial", short)):
        if keys:
            return (
                f"refusing to save a LoRA adapter with {len(keys)} of {len(expected)} tensors {what} "
                f"(first: {keys[0]}); under ZeRO-3 the adapter must be gathered before it is read"
            )
    return None


def lora_save_arguments(family: Family, state: dict[str, torch.Tensor], config: Any) -> dict[str, Any]:
    """The keyword arguments of the family pipeline's `save_lora_weights`, as diffusers' LoRA scripts
    pass them: UNet adapters converted to the diffusers key format, SD3's transformer adapters as peft
    names them, with the LoraConfig as metadata (so an alpha other than the rank loads as trained)."""
    from diffusers.utils import convert_state_dict_to_diffusers

    attr = family.network_attr
    layers = convert_state_dict_to_diffusers(state) if attr == "unet" else state
    metadata = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {f"{attr}_lora_layers": layers, f"{attr}_lora_adapter_metadata": metadata}


def write_lora(
    folder: Path, family: Family, state: dict[str, torch.Tensor], config: Any, name: str = LORA_WEIGHTS
) -> Path:
    """`folder/name` in the diffusers LoRA format (safetensors), written by the family pipeline's own
    `save_lora_weights`, so that `pipeline.load_lora_weights(folder)` reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    family.pipeline_class().save_lora_weights(
        str(folder), **lora_save_arguments(family, state, config), weight_name=name, safe_serialization=True
    )
    return folder / name


def merged_state(
    network: torch.nn.Module, state: dict[str, torch.Tensor], settings: Any
) -> dict[str, torch.Tensor]:
    """The base network's weights with the adapter fused in (W + alpha/rank * B A), from `state` (the
    adapted network's full state: base and adapters, module names), on a fresh CPU copy built from
    `network`'s config; diffusers' fuse_lora then unload_lora leave plain layers holding the fused weights."""
    fresh = type(network).from_config(network.config)
    add_lora(fresh, settings)
    missing, unexpected = fresh.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"merge: state does not fit the network (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    fresh.fuse_lora()
    fresh.unload_lora()
    return {k: v.detach().contiguous() for k, v in fresh.state_dict().items()}


def frozen_base_kwargs(engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(save_checkpoint, load_checkpoint) arguments for a network with frozen parameters, a LoRA run's
    base: it comes from --model at every start (the run identity pins the model), so checkpoints leave it
    out and hold what training changed, and a load does not expect it. Empty for a full fine-tune."""
    module = getattr(engine, "module", None)
    if module is None or all(p.requires_grad for p in module.parameters()):
        return {}, {}
    return {"exclude_frozen_parameters": True}, {"load_module_strict": False}
