"""sdzero: fine-tune Stable Diffusion with DeepSpeed ZeRO on one machine or many."""

__version__ = "0.1.0"
