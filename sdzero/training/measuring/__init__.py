"""Measuring the trainer's own step, for `sdzero profile` and the advisor's launches (docs/trainer.md).

Measuring a step is a callback's job: `probe.Probe` (one config, `--profile-out`) and
`config_probe.ConfigProbe` (one config of a launch) sit in the Trainer's measuring slot. Choosing which steps
run is a driver's: `sweep.ConfigSweep` takes a built Trainer and drives its `train_step` over several configs
(`--profile-configs`), with `configs` (the launch's options), `race` (when it has measured enough) and
`instruments` (DeepSpeed's synchronizing instruments, the tie, out-of-memory) beside it; `comm_meters`
holds DeepSpeed's collective meters that the probes read.
"""
