"""The training loop: Trainer, its callbacks, the probe, the engine, GPU fast paths, validation, run output."""
