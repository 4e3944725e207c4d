"""The DeepSpeed engine around the trained network: its JSON, optimizer and LR schedule."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from sdzero.config.train_config import DsSettings, TrainConfig, rank_from_env
from sdzero.models.families import Components
from sdzero.models.lora import LoraSettings, add_lora
from sdzero.training.adam_kernel import choose_adam
from sdzero.training.fast_paths import adamw_options, compile_engine, prepare_network

log = logging.getLogger("sdzero.training.engine")

QUIET_THROUGHPUT_TIMER = {"throughput": {"enabled": False, "synchronized": False}}
"""DeepSpeed's throughput timer, off unless the JSON has a `timers` section. It is on and synchronized by
default (deepspeed/utils/config.py), and with no training data given to `deepspeed.initialize` the engine
starts it in every forward and stops it in every `step()` (runtime/engine.py), each a device-wide
synchronize: two host-device syncs per micro-step. sdzero measures samples/s itself (metrics.jsonl)."""


def effective_ds_config(cfg: TrainConfig, ds: DsSettings, universal: bool = False) -> dict[str, Any]:
    """The JSON handed to DeepSpeed: the user's file with the resolved LR written into the optimizer,
    `checkpoint.load_universal` when resuming on another world size (sdzero.checkpoint.universal), and
    DeepSpeed's throughput timer off unless the file configures its timers."""
    config = json.loads(json.dumps(ds.raw))
    if "optimizer" in config:
        config["optimizer"].setdefault("params", {})["lr"] = cfg.effective_lr(ds)
    if universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    config.setdefault("timers", json.loads(json.dumps(QUIET_THROUGHPUT_TIMER)))
    return config


def make_lr_scheduler(cfg: TrainConfig, ds: DsSettings):
    if "scheduler" in ds.raw or cfg.lr_warmup_steps <= 0:
        return None  # DeepSpeed's own scheduler section, or a constant LR
    warmup = cfg.lr_warmup_steps
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup)
    )


def init_engine(cfg: TrainConfig, ds: DsSettings, comps: Components, universal: bool = False):
    import deepspeed

    if cfg.gradient_checkpointing:
        comps.network.enable_gradient_checkpointing()
    lora = LoraSettings.of(cfg, comps.family)
    if lora is not None:  # --lora-rank: the base frozen, only the adapters reach the optimizer below
        add_lora(comps.network, lora)
    params = [p for p in comps.network.parameters() if p.requires_grad]
    device_type = get_accelerator_device_type()
    config, adam_line = choose_adam(effective_ds_config(cfg, ds, universal), device_type)
    if adam_line is not None and rank_from_env() == 0:
        log.warning(adam_line)
    optimizer = None
    if "optimizer" not in config:
        optimizer = torch.optim.AdamW(params, lr=cfg.effective_lr(ds), **adamw_options(device_type))
    engine, _, _, _ = deepspeed.initialize(
        model=comps.network,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=make_lr_scheduler(cfg, ds),
        config=config,
    )
    prepare_network(cfg, engine.module)  # --channels-last, --attention: hooks on the trained network
    compile_engine(cfg, engine)  # --compile: in place, after ZeRO has laid out the parameters
    return engine, config


def get_accelerator_device_type() -> str:
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().device_name())


def loss_scale_of(engine) -> float | None:
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    scale = getattr(opt, "loss_scale", None)
    if scale is None and hasattr(opt, "cur_scale"):
        scale = opt.cur_scale
    return float(scale) if scale is not None else None
