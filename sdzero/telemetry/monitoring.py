"""The monitoring extras (`sdzero[tensorboard]`, `[wandb]`): DeepSpeed's own monitor sections do the
logging; what they leave undone is done here."""

from __future__ import annotations

import sys


def finish_wandb_run() -> None:
    """Close the W&B run that DeepSpeed's `wandb` monitor opened (rank 0), if any.

    DeepSpeed never calls wandb.finish(): at interpreter exit wandb's service is torn down first, so an
    offline run lacks its summary (and an online one shows as crashed).
    """
    wandb = sys.modules.get("wandb")  # imported only by the monitor: never import it here
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
