"""Run options, the trainer config, the DeepSpeed JSON reader and the LR rule: the bottom floor, no torch."""
