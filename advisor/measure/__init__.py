"""Measurement: the trainer's trials over a grid of configs, and the collectives benchmark."""
